"""POST /v1/responses (OpenAI's Responses API), GET and DELETE
/v1/responses/{id}: a response runs as the chat completion it asks for
(server/responses_protocol.py) and its output is written as Responses
output items: the text as one `message` item, each tool call as a
`function_call` item; streamed as the Responses events (response.created,
output_item.added, output_text.delta, function_call_arguments.delta, ...,
response.completed), each with its sequence_number.

Stored responses (`store`, OpenAI's default) are kept in memory, the newest
`responses_store_size` of them, with the conversation that led to them, so
`previous_response_id` continues one and GET returns it; a server restart
forgets them. A `background` response (stored) is answered at once,
`queued`, and runs on: GET follows it (`in_progress`, then `completed`),
POST /v1/responses/{id}/cancel ends it (`cancelled`, its request aborted).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from qoqserve.engine.output import RequestOutput
from qoqserve.server import choices as joined
from qoqserve.server.protocol import APIError, ChatCompletionRequest, from_validation_errors
from qoqserve.server.responses_items import EventWriter, message_item, output_items, turn
from qoqserve.server.responses_protocol import ResponsesRequest
from qoqserve.server.serving import OpenAIServing, failed_output


@dataclass
class Stored:
    body: dict            # the response as returned
    messages: list[dict]  # the conversation up to and with its output, as chat messages


class ResponsesServing:
    def __init__(self, serving: OpenAIServing, store_size: int = 256):
        self.serving = serving
        self.store_size = store_size
        self.stored: OrderedDict[str, Stored] = OrderedDict()
        self.background: dict[str, asyncio.Task] = {}  # the background responses still running

    def get(self, response_id: str) -> dict:
        return self._stored(response_id, None).body

    def cancel(self, response_id: str) -> dict:
        body = self._stored(response_id, None).body
        task = self.background.get(response_id)
        if task is not None:
            task.cancel()  # its request is aborted as the task unwinds
            body["status"] = "cancelled"
        elif not body.get("background"):
            raise APIError(400, "only a background response can be cancelled", param="response_id")
        return body

    def delete(self, response_id: str) -> dict:
        self._stored(response_id, None)
        del self.stored[response_id]
        return {"id": response_id, "object": "response", "deleted": True}

    def _stored(self, response_id: str, param: str | None) -> Stored:
        s = self.stored.get(response_id)
        if s is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", param=param,
                           type="not_found_error")
        return s

    async def create(self, req: ResponsesRequest, raw: Request):
        history = ([] if req.previous_response_id is None
                   else self._stored(req.previous_response_id, "previous_response_id").messages)
        try:
            chat = ChatCompletionRequest.model_validate(req.chat_fields(history))
        except ValidationError as e:
            raise from_validation_errors(list(e.errors())) from None
        if req.background and (not req.store or req.stream):
            raise APIError(400, "background needs store: true, and is not streamed here",
                           param="store" if not req.store else "stream")
        choices = await self.serving.chat_choices(chat)
        run = Run(self, req, chat, f"resp_{uuid.uuid4().hex}", int(time.time()))
        outputs = joined.merged(choices, stagger=False)
        if req.background:
            body = run.body("queued", [])
            self.keep(body, [])
            task = self.background[run.id] = asyncio.ensure_future(self._run_background(run, choices, outputs))
            task.add_done_callback(lambda _: self.background.pop(run.id, None))
            return JSONResponse(body)
        if req.stream:
            return StreamingResponse(run.events(outputs), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        final = (await self.serving.collect(outputs, 1, raw))[0]
        return JSONResponse(run.finish(output_items(choices[0].fmt.choice(final)), final))

    async def _run_background(self, run: Run, choices, outputs) -> None:
        last = None
        try:
            async for _, out in outputs:
                if out.finish_reason == "error":
                    raise failed_output(out)
                if last is None and run.id in self.stored:
                    self.stored[run.id].body["status"] = "in_progress"
                last = out
            run.finish(output_items(choices[0].fmt.choice(last)), last)
        except asyncio.CancelledError:
            pass  # cancel() marked it; the request is aborted below
        except Exception as e:
            self.keep(run.failed(e, []), [])
        finally:
            await outputs.aclose()

    def keep(self, body: dict, messages: list[dict]) -> None:
        self.stored[body["id"]] = Stored(body, messages)
        while len(self.stored) > self.store_size:
            self.stored.popitem(last=False)


class Run:
    """One response: its request, the items its output becomes, its events."""

    def __init__(self, owner: ResponsesServing, req: ResponsesRequest, chat: ChatCompletionRequest,
                 response_id: str, created: int):
        self.owner, self.req, self.chat, self.id, self.created = owner, req, chat, response_id, created
        self.seq = 0

    def body(self, status: str, output: list[dict], final: RequestOutput | None = None) -> dict:
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        body = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None, "incomplete_details": None, "model": self.owner.serving.model_name, "output": output,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
            "temperature": req.temperature, "top_p": req.top_p, "store": req.store,
            "tool_choice": (req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None
                            else req.tool_choice.model_dump()) or ("auto" if req.tools else "none"),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "text": {"format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt else {"type": "text"}},
            "metadata": req.metadata or {}, "truncation": "disabled", "background": req.background,
            "usage": None}
        if final is not None:
            n_in, n_out = len(final.prompt_token_ids), len(final.token_ids)
            body["usage"] = {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
                             "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": n_in + n_out}
            if final.finish_reason == "length":
                body["status"], body["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        return body

    def failed(self, e: Exception, output: list[dict]) -> dict:
        """The response as it stands when e ended it (status failed, OpenAI's error)."""
        err = e if isinstance(e, APIError) else APIError(500, str(e), type="server_error")
        body = self.body("failed", output)
        body["error"] = {"code": err.code or err.type, "message": err.message}
        return body

    def finish(self, output: list[dict], final: RequestOutput) -> dict:
        """The response of these output items, stored when asked."""
        body = self.body("completed", output, final)
        if self.req.store:
            # OpenAI's rule: a response that continues this one does not inherit its instructions
            messages = self.chat.model_dump(exclude_unset=True)["messages"][self.req.instructions is not None:]
            self.owner.keep(body, messages + [turn(output)])
        return body

    def event(self, kind: str, **fields) -> str:
        self.seq += 1
        data = json.dumps({"type": kind, "sequence_number": self.seq - 1, **fields}, ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n"

    async def events(self, outputs):
        stream = EventWriter(self, trim=bool(self.chat.tools) and self.chat.tool_choice != "none")
        yield self.event("response.created", response=self.body("in_progress", []))
        yield self.event("response.in_progress", response=self.body("in_progress", []))
        try:
            async for c, out in outputs:
                if out.finish_reason == "error":
                    raise failed_output(out)
                delta = c.fmt.delta_choice(out)
                if delta is not None:
                    for e in stream.delta(delta):
                        yield e
                if out.finished:
                    for e in stream.close_all():
                        yield e
                    body = self.finish(stream.items or [message_item("", None, "completed")], out)
                    yield self.event(f"response.{body['status']}", response=body)  # completed or incomplete
        except Exception as e:  # headers are gone: the failure travels in the stream
            yield self.event("response.failed", response=self.failed(e, stream.items))
        finally:
            await outputs.aclose()  # a client that left mid-stream frees its pages now
