"""OpenAI requests -> engine requests: the API's own fields, streaming, disconnects.

The request schemas (protocol.py) check types, ranges and text as FastAPI
parses the body; the engine's admission (engine/admission.py) checks
prompts, limits and sampling parameters again, as it does for the Python
API; this layer checks only what belongs to the OpenAI API (model name,
unsupported fields) and maps the engine's errors to OpenAI errors. All of
it happens before the stream starts, so a stream only starts once the
request is known to be good. A response's choices (`n`, several prompts)
are engine requests of their own (server/choices.py). A request the engine
later ends with finish_reason "error" gets a 500 server_error, or a 400 when
the engine found it to be the request's own fault (error_code: a grammar
the vocabulary cannot continue); streams get an error event after the
chunks already sent, then [DONE].
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from qoqserve.engine.admission import PreparedRequest
from qoqserve.engine.output import RequestOutput
from qoqserve.errors import InvalidRequestError
from qoqserve.sampling_params import SamplingParams, StructuredOutputs
from qoqserve.server import choices as joined
from qoqserve.server.async_engine import AsyncEngine
from qoqserve.server.chat_prompt import chat_prompt_ids
from qoqserve.server.choices import Choice
from qoqserve.server.config import ServerConfig
from qoqserve.server.formats import ChatFormat, CompletionFormat, Format, ranked_prompt_logprobs
from qoqserve.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatTemplateFields,
    CompletionRequest,
    SamplingFields,
    function_dicts,
)
from qoqserve.server.reasoning import ReasoningSplitter, after_reasoning, opens_reasoning
from qoqserve.server.structured import requested_structure, spec_or_400
from qoqserve.server.tools import (
    ToolCallParser,
    tool_structural_tag,
)


class ClientGone(Exception):
    pass


def failed_output(out: RequestOutput) -> APIError:
    """A request the engine ended because a step failed on it: the server's
    fault, unless the engine found the request's own (error_code)."""
    if out.error_code is not None:
        return APIError(400, out.error, code=out.error_code)
    return APIError(500, f"the request failed in the engine: {out.error}", type="server_error",
                    code="engine_error")


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, config: ServerConfig, model_names: list[str]):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_names = model_names  # any may be asked for
        self.model_name = model_names[0]  # what answers carry
        self.max_model_len = engine.max_model_len
        self.defaults = engine.sampling_defaults  # the model's generation config (vLLM's default)
        self.trust_request_chat_template = config.trust_request_chat_template
        self.reasoning_parser = config.reasoning_parser

    # ---- validation -----------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"The model `{name}` does not exist.", param="model",
                           code="model_not_found")

    async def _prepare(self, req: SamplingFields, prompt: str | list[int], max_tokens: int | None,
                       prompt_param: str, logprobs: bool = False, top_logprobs: int = 0,
                       structure: tuple[StructuredOutputs | None, str | None] = (None, None),
                       add_special_tokens: bool = True) -> PreparedRequest:
        """The engine's admission of this request; its errors as OpenAI 400s.
        structure: (the output's constraint, the request field it came from).
        A constrained request is admitted on a worker thread: compiling its
        grammar (cached per spec) may take a while, and must stall neither
        the event loop nor the engine."""
        spec, spec_param = structure
        given = {k: getattr(req, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
        given["max_tokens"] = max_tokens
        # what the request leaves out: the model's default, else SamplingParams' own
        sampling = {k: v if v is not None else self.defaults[k] for k, v in given.items()
                    if v is not None or k in self.defaults}
        sampling.setdefault("max_tokens", None)  # None: the rest of the context window
        try:
            params = SamplingParams(
                **sampling, min_tokens=req.min_tokens, seed=req.seed,
                stop=req.stop, stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos,
                logprobs=logprobs, top_logprobs=top_logprobs,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                include_stop_str_in_output=req.include_stop_str_in_output, structured_outputs=spec,
                skip_special_tokens=req.skip_special_tokens,
                logit_bias=req.token_biases(), allowed_token_ids=req.allowed_token_ids,
                bad_words=req.bad_words, truncate_prompt_tokens=req.truncate_prompt_tokens)
            args = (prompt, params, True, add_special_tokens, req.priority)
            if spec is None:
                return self.engine.prepare_request(*args)
            return await asyncio.to_thread(self.engine.prepare_request, *args)
        except InvalidRequestError as e:
            param = prompt_param if e.param == "prompt" else e.param
            if param and param.startswith("structured_outputs") and spec_param:
                param = spec_param
            raise APIError(400, str(e), param=param, code=e.code) from None

    # ---- endpoints --------------------------------------------------------------

    async def completion(self, req: CompletionRequest, raw: Request):
        self.check_model(req.model)
        if (req.best_of or 1) != 1:
            raise APIError(400, "best_of must be 1", param="best_of")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompts = req.prompt
        if not (isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list))):
            prompts = [prompts]  # one prompt: text or token ids
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise APIError(400, f"logprobs must be in [0, 20], got {req.logprobs}", param="logprobs")
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo: the prompt scored alone)",
                           param="max_tokens")
        score_only = req.max_tokens == 0  # echo (with logprobs: the prompt's), nothing generated
        prepared = [await self._prepare(req, prompt, 1 if score_only else req.max_tokens, "prompt",
                                        logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0,
                                        add_special_tokens=req.add_special_tokens,
                                        structure=requested_structure(req))
                    for prompt in prompts]  # all admitted before any starts
        rid, created, choices = f"cmpl-{uuid.uuid4().hex}", int(time.time()), []
        for p, (prompt, request) in enumerate(zip(prompts, prepared)):
            ids = request.prompt_token_ids
            echo = ((prompt if isinstance(prompt, str) and req.truncate_prompt_tokens is None
                     else self.tokenizer.decode(ids)) if req.echo else "")
            scored, ranked = await self._scored_prompt(req, ids, req.logprobs if req.echo else None)
            choices += self._choices(
                request, req.n, p, lambda i, p=p, n=len(ids), echo=echo, scored=scored, ranked=ranked:
                CompletionFormat(rid, self.model_name, self.tokenizer, n, index=p * req.n + i, created=created,
                                 echo_text=echo, prompt_logprobs=scored, ranked_prompt=ranked,
                                 tokens_as_ids=req.return_tokens_as_token_ids),
                start=not score_only)
        return await self._respond(choices, req, raw)

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        return await self._respond(await self.chat_choices(req), req, raw)

    async def chat_choices(self, req: ChatCompletionRequest) -> list[Choice]:
        """The request's choices, admitted and started (the Responses API's too)."""
        self.check_model(req.model)
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        structure = requested_structure(req)
        tools, choice = self._tool_choice(req)
        calls = bool(tools) and choice != "none"  # constrained to, and parsed for, tool calls
        if calls and structure[0] is not None:
            raise APIError(400, f"{structure[1]} cannot be combined with tool calls (send tool_choice "
                                '"none" to constrain the text instead)', param=structure[1])
        if calls:
            tag = tool_structural_tag(tools, choice, req.parallel_tool_calls)
            structure = spec_or_400({"structural_tag": tag}, "tools"), "tools"
        ids = self.chat_prompt(req, req.messages, tools, req.add_special_tokens)
        thinks = self.reasoning_parser is not None and opens_reasoning(self.tokenizer.decode(ids[-16:], False))
        if self.reasoning_parser is not None and structure[0] is not None:
            structure = after_reasoning(structure[0], thinks), structure[1]
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        prepared = await self._prepare(req, ids, max_tokens, "messages", logprobs=req.logprobs,
                                       top_logprobs=req.top_logprobs or 0, structure=structure)
        ids = prepared.prompt_token_ids  # truncate_prompt_tokens may have cut it
        _, ranked = await self._scored_prompt(req, ids)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        choices = self._choices(prepared, req.n, 0, lambda i: ChatFormat(
            rid, self.model_name, self.tokenizer, len(ids), index=i, created=created, ranked_prompt=ranked,
            tool_parser=ToolCallParser() if calls else None, tokens_as_ids=req.return_tokens_as_token_ids,
            reasoning=None if self.reasoning_parser is None else ReasoningSplitter(thinks),
            include_reasoning=req.include_reasoning))
        return choices

    async def _scored_prompt(self, req: SamplingFields, ids: list[int], echo_top: int | None = None
                             ) -> tuple[tuple | None, list | None]:
        """One scored pass over the prompt, when anything asks for it: (with echo_top,
        OpenAI's echoed prompt logprobs (ids, logprobs, tops; the first null),
        with prompt_logprobs, vLLM's; not in a stream)."""
        k = req.prompt_logprobs
        if k is not None and req.stream:
            raise APIError(400, "prompt_logprobs is not available with stream", param="prompt_logprobs")
        if k is None and echo_top is None:
            return None, None
        chosen, tops, ranks = await self.engine.prompt_logprobs(ids, max(k or 0, echo_top or 0))
        tops = tops or [[] for _ in chosen]
        echoed = None if echo_top is None else (ids, [None, *chosen], [None, *(t[:echo_top] for t in tops)])
        ranked = None if k is None else ranked_prompt_logprobs(self.tokenizer, ids, chosen, [t[:k] for t in tops],
                                                               ranks)
        return echoed, ranked

    def chat_prompt(self, req: ChatTemplateFields, messages: list, tools: list[dict],
                    add_special_tokens: bool = False) -> list[int]:
        """The conversation's prompt ids (server/chat_prompt.py), as this server renders it."""
        return chat_prompt_ids(self.tokenizer, req, messages, tools, self.trust_request_chat_template,
                               add_special_tokens)

    @staticmethod
    def _tool_choice(req: ChatCompletionRequest) -> tuple[list[dict], str | dict]:
        """(the functions, tool_choice). With "none" the tools are still in the
        prompt, as vLLM does, but the output is neither constrained nor parsed."""
        tools = function_dicts(req.tools)
        choice = req.tool_choice or ("auto" if tools else "none")
        if choice == "none":
            return tools, choice
        if not tools:
            raise APIError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
        if not isinstance(choice, str):
            choice = choice.model_dump()
            if choice["function"]["name"] not in {f["name"] for f in tools}:
                raise APIError(400, f"tool_choice names {choice['function']['name']!r}, which is not in tools",
                               param="tool_choice")
        return tools, choice

    # ---- running ----------------------------------------------------------------

    def _choices(self, prepared: PreparedRequest, n: int, prompt: int,
                 make_format: Callable[[int], Format], start: bool = True) -> list[Choice]:
        """The n choices of one prompt, each an engine request (raises before
        any output if the engine cannot take them all); start False: none, each
        choice its prompt alone (max_tokens 0)."""
        choices = []
        for i in range(n):
            fmt = make_format(i)
            rid = fmt.id if fmt.index == 0 else f"{fmt.id}-{fmt.index}"  # one choice: the response's id
            outputs = (self.engine.generate(rid, joined.child_request(prepared, i)) if start
                       else joined.prompt_only(rid, prepared))
            choices.append(Choice(fmt, outputs, prompt, i == 0))
        return choices

    async def _respond(self, choices: list[Choice], req: SamplingFields, raw: Request):
        outputs = joined.merged(choices, stagger=self.engine.shares_prefixes)
        if req.stream:
            opts = req.stream_options
            usage = bool(opts and opts.include_usage)
            return StreamingResponse(self._sse(outputs, choices, usage, usage and opts.continuous_usage_stats),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        finals = await self.collect(outputs, len(choices), raw)
        return JSONResponse(joined.response(choices, finals))

    async def collect(self, outputs: AsyncIterator[tuple[Choice, RequestOutput]], choices: int,
                       raw: Request) -> dict[int, RequestOutput]:
        """Each choice's final output, by index; aborts the requests if the
        client hangs up while waiting."""
        async def drain():
            last: dict[int, RequestOutput] = {}
            try:
                async for c, out in outputs:
                    if out.finish_reason == "error":
                        raise failed_output(out)
                    last[c.fmt.index] = out
            finally:
                await outputs.aclose()  # one choice failed: the others are aborted now
            if len(last) < choices:
                raise APIError(500, "a request ended without output", type="server_error")
            return last

        task = asyncio.ensure_future(drain())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if done:
                    return task.result()
                if await raw.is_disconnected():
                    raise ClientGone()
        finally:
            if not task.done():
                task.cancel()  # the generator's cleanup aborts the requests and frees their pages

    async def _sse(self, outputs: AsyncIterator[tuple[Choice, RequestOutput]], choices: list[Choice],
                   include_usage: bool, continuous_usage: bool = False):
        last: dict[int, RequestOutput] = {}
        try:
            async for c, out in outputs:
                last[c.fmt.index] = out
                if out.finish_reason == "error":  # what was streamed stands; the error ends it
                    raise failed_output(out)
                chunk = c.fmt.chunk(out)
                if chunk is not None:
                    if continuous_usage:
                        chunk["usage"] = joined.usage(choices, last)
                    yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            if include_usage and last:
                yield f"data: {json.dumps(joined.usage_chunk(choices, last))}\n\n"
        except Exception as e:  # headers are gone: the error travels in the stream
            err = e if isinstance(e, APIError) else APIError(500, str(e), type="server_error")
            yield f"data: {json.dumps(err.body())}\n\n"
        finally:
            await outputs.aclose()  # a client that left mid-stream frees its pages now
        yield "data: [DONE]\n\n"
