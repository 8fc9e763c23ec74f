"""OpenAI requests -> engine requests: the API's own fields, streaming, disconnects.

The request schemas (protocol.py) check types, ranges and text as FastAPI
parses the body; the engine's admission (engine/admission.py) checks
prompts, limits and sampling parameters again, as it does for the Python
API; this layer checks only what belongs to the OpenAI API (model name, n,
unsupported fields) and maps the engine's errors to OpenAI errors. All of
it happens before the stream starts, so a stream only starts once the
request is known to be good. A request the engine later ends with
finish_reason "error" gets a 500 server_error (streams: an error event,
after the chunks already sent, then [DONE]).
"""
from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from qoqserve.engine.admission import PreparedRequest
from qoqserve.engine.output import RequestOutput
from qoqserve.errors import InvalidRequestError
from qoqserve.sampling_params import SamplingParams
from qoqserve.server.async_engine import AsyncEngine
from qoqserve.server.config import ServerConfig
from qoqserve.server.formats import ChatFormat, CompletionFormat, Format
from qoqserve.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)


class ClientGone(Exception):
    pass


def _failed(out: RequestOutput) -> APIError:
    """A request the engine ended because a step failed on it: the server's fault."""
    return APIError(500, f"the request failed in the engine: {out.error}", type="server_error",
                    code="engine_error")


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, config: ServerConfig, model_name: str):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.max_model_len = engine.max_model_len

    # ---- validation -----------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", param="model",
                           code="model_not_found")

    def _check_common(self, req: SamplingFields) -> None:
        self.check_model(req.model)
        if req.n != 1:
            raise APIError(400, f"n must be 1, got {req.n}", param="n")
        if req.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")

    def _prepare(self, req: SamplingFields, prompt: str | list[int], max_tokens: int | None,
                 prompt_param: str, logprobs: bool = False, top_logprobs: int = 0) -> PreparedRequest:
        """The engine's admission of this request; its errors as OpenAI 400s."""
        try:
            params = SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k in (None, 0) else req.top_k,
                max_tokens=max_tokens, min_tokens=req.min_tokens, seed=req.seed, stop=req.stop,
                stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos,
                logprobs=logprobs, top_logprobs=top_logprobs,
                repetition_penalty=req.repetition_penalty or 1.0,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                include_stop_str_in_output=req.include_stop_str_in_output)
            return self.engine.prepare_request(prompt, params, max_tokens_must_fit=True)
        except InvalidRequestError as e:
            param = prompt_param if e.param == "prompt" else e.param
            raise APIError(400, str(e), param=param, code=e.code) from None

    # ---- endpoints --------------------------------------------------------------

    async def completion(self, req: CompletionRequest, raw: Request):
        self._check_common(req)
        if (req.best_of or 1) != 1:
            raise APIError(400, "best_of must be 1", param="best_of")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "send one prompt per request (batched prompts are not supported)",
                               param="prompt")
            prompt = prompt[0]
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise APIError(400, f"logprobs must be in [0, 20], got {req.logprobs}", param="logprobs")
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo together with logprobs is not supported", param="echo")
        prepared = self._prepare(req, prompt, req.max_tokens, "prompt",
                                 logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0)
        ids = prepared.prompt_token_ids
        echo = (prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)) if req.echo else ""
        fmt = CompletionFormat(f"cmpl-{uuid.uuid4().hex}", self.model_name, self.tokenizer, len(ids),
                               echo_text=echo)
        return await self._respond(fmt, prepared, req, raw)

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        self._check_common(req)
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        if req.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise APIError(400, "only response_format {\"type\": \"text\"} is supported",
                           param="response_format")
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, req.add_generation_prompt)
        except Exception as e:  # templates raise on e.g. roles out of order
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        # the template already carries BOS where the model wants one
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        prepared = self._prepare(req, ids, max_tokens, "messages", logprobs=req.logprobs,
                                 top_logprobs=req.top_logprobs or 0)
        fmt = ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", self.model_name, self.tokenizer, len(ids))
        return await self._respond(fmt, prepared, req, raw)

    # ---- running ----------------------------------------------------------------

    async def _respond(self, fmt: Format, prepared: PreparedRequest, req: SamplingFields,
                       raw: Request):
        outputs = self.engine.generate(fmt.id, prepared)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._sse(outputs, fmt, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        final = await self._collect(outputs, raw)
        return JSONResponse(fmt.response(final))

    async def _collect(self, outputs: AsyncIterator[RequestOutput], raw: Request) -> RequestOutput:
        """The final output; aborts the request if the client hangs up while waiting."""
        async def drain():
            last = None
            async for out in outputs:
                last = out
            return last

        task = asyncio.ensure_future(drain())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if done:
                    return self._final(task.result())
                if await raw.is_disconnected():
                    raise ClientGone()
        finally:
            if not task.done():
                task.cancel()  # the generator's cleanup aborts the request and frees its pages

    @staticmethod
    def _final(out: RequestOutput | None) -> RequestOutput:
        if out is None:
            raise APIError(500, "the request ended without output", type="server_error")
        if out.finish_reason == "error":
            raise _failed(out)
        return out

    async def _sse(self, outputs: AsyncIterator[RequestOutput], fmt: Format, include_usage: bool):
        last = None
        try:
            async for out in outputs:
                last = out
                if out.finish_reason == "error":  # what was streamed stands; the error ends it
                    raise _failed(out)
                chunk = fmt.chunk(out)
                if chunk is not None:
                    yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            if include_usage and last is not None:
                yield f"data: {json.dumps(fmt.usage_chunk(last))}\n\n"
        except Exception as e:  # headers are gone: the error travels in the stream
            err = e if isinstance(e, APIError) else APIError(500, str(e), type="server_error")
            yield f"data: {json.dumps(err.body())}\n\n"
        finally:
            await outputs.aclose()  # a client that left mid-stream frees its pages now
        yield "data: [DONE]\n\n"
