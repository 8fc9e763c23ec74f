"""The choices of one OpenAI response (`n` > 1, or several prompts on
/v1/completions) as engine requests, and their outputs joined back into one
response or one stream.

Each choice is an engine request of its own: its own seed (the request's
seed + the choice's number among its prompt's choices, as vLLM does, so
seeded choices differ from each other and repeat across calls), its own
grammar matcher and stop state. The choices of one prompt share its KV
pages through the prefix cache: the first starts alone and the others once
it has produced a token, when the prompt's full pages are cached, so n
choices of a long prompt cost one prefill instead of n. Without a prefix
cache all start at once.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

from qoqserve.engine.admission import PreparedRequest
from qoqserve.engine.output import RequestOutput
from qoqserve.sampling_params import SEED_RANGE
from qoqserve.server.formats import Format


@dataclass
class Choice:
    fmt: Format                          # knows the choice's index in the response
    outputs: AsyncIterator[RequestOutput]
    prompt: int                          # which of the request's prompts
    leader: bool                         # the first choice of its prompt


def child_request(prepared: PreparedRequest, i: int) -> PreparedRequest:
    """Choice i of a prompt: the same request, seed + i (wrapping within the seed range)."""
    seed = prepared.params.seed
    if i == 0 or seed is None:
        return prepared
    lo, hi = SEED_RANGE
    seed = (seed + i - lo) % (hi - lo + 1) + lo
    return dataclasses.replace(prepared, params=dataclasses.replace(prepared.params, seed=seed))


async def prompt_only(request_id: str, prepared: PreparedRequest) -> AsyncIterator[RequestOutput]:
    """The output of a choice that generates nothing (max_tokens 0 with echo)."""
    params = prepared.params
    yield RequestOutput(request_id=request_id, prompt_token_ids=prepared.prompt_token_ids, token_ids=[], text="",
                        delta_text="", delta_token_ids=[], finished=True, finish_reason="length",
                        logprobs=[] if params.logprobs else None, top_logprobs=[] if params.top_logprobs else None)


def usage(choices: list[Choice], finals: dict[int, RequestOutput]) -> dict:
    """OpenAI's usage: each prompt counted once, every choice's tokens."""
    prompt = sum(c.fmt.num_prompt_tokens for c in choices if c.leader)
    completion = sum(len(finals[c.fmt.index].token_ids) for c in choices if c.fmt.index in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def response(choices: list[Choice], finals: dict[int, RequestOutput]) -> dict:
    first = choices[0].fmt
    body = first.envelope(first.object_name, [c.fmt.choice(finals[c.fmt.index]) for c in choices])
    body.update(first.response_fields())
    body["usage"] = usage(choices, finals)
    return body


def usage_chunk(choices: list[Choice], finals: dict[int, RequestOutput]) -> dict:
    first = choices[0].fmt
    body = first.envelope(first.chunk_object_name, [])
    body["usage"] = usage(choices, finals)
    return body


async def merged(choices: list[Choice], stagger: bool) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """Every choice's outputs as they come, (choice, output). An exception of
    any choice ends the iteration with it; leaving early (error, client gone)
    closes every choice's stream, which aborts its request."""
    if len(choices) == 1:  # the common case: no tasks, no queue
        try:
            async for out in choices[0].outputs:
                yield choices[0], out
        finally:
            await choices[0].outputs.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    prefilled = {c.prompt: asyncio.Event() for c in choices}

    async def pump(c: Choice) -> None:
        try:
            if stagger and not c.leader:
                await prefilled[c.prompt].wait()
            async for out in c.outputs:
                if c.leader:
                    prefilled[c.prompt].set()
                queue.put_nowait((c, out))
            queue.put_nowait((c, None))
        except Exception as e:
            queue.put_nowait((c, e))
        finally:
            if c.leader:  # ended or failed: the others need not wait any longer
                prefilled[c.prompt].set()

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        running = len(choices)
        while running:
            c, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield c, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in choices:
            await c.outputs.aclose()
