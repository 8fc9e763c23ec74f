"""A bounded waiting queue: past --max-waiting-queue-length new requests get a
429 with Retry-After and an OpenAI-shaped error, at once, streaming or not,
while the admitted ones finish exactly as they would alone; every place in
the queue and every page comes back.

In-process server (conftest.in_process_server) over a runner slowed to
SLOW_S per step, so the admitted requests are certainly still waiting for
their first token while the rest arrive: the count of 429s is exact.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
from conftest import in_process_server

from qoqserve.cli.main import build_parser
from qoqserve.engine.isolation import StepIsolation
from qoqserve.sampling_params import SamplingParams
from qoqserve.server.config import ServerConfig
from qoqserve.server.responses import ErrorResponse

SLOW_S = 0.5
BOUND = 2
CLIENTS = 8
PROMPTS = [f"Request {i}: tell me about the river and the city" for i in range(CLIENTS)]
MAX_TOKENS = 4


class SlowRunner:
    def __init__(self, inner):
        self.inner = inner

    def run(self, batch):
        time.sleep(SLOW_S)
        return self.inner.run(batch)

    def __getattr__(self, name):
        return getattr(self.inner, name)


async def _send(client, base, i):
    body = {"prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": i % 2 == 1}
    r = await client.post(base + "/v1/completions", json=body)
    if r.status_code != 200:
        return i, r, None
    if body["stream"]:
        text = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in r.text.splitlines()
                       if ln.startswith("data: ") and ln != "data: [DONE]")
        return i, r, text
    return i, r, r.json()["choices"][0]["text"]


def test_a_full_queue_answers_429_with_retry_after_and_the_admitted_finish(reference_llm, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = {i: reference_llm.generate(p, params)[0].text for i, p in enumerate(PROMPTS)}
    engine = reference_llm.engine
    monkeypatch.setattr(engine, "isolation", StepIsolation(SlowRunner(engine.runner)))
    with in_process_server(engine, ServerConfig(max_waiting_queue_length=BOUND)) as (base, async_engine):
        async def run():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(_send(client, base, i) for i in range(CLIENTS)))

        t0 = time.monotonic()
        results = asyncio.run(run())
        refused = [(i, r) for i, r, _ in results if r.status_code == 429]
        admitted = [(i, text) for i, r, text in results if r.status_code == 200]
        assert len(refused) == CLIENTS - BOUND and len(admitted) == BOUND, \
            [(i, r.status_code) for i, r, _ in results]
        for i, r in refused:
            assert r.headers["retry-after"] == "1"
            err = ErrorResponse.model_validate(r.json()).error
            assert err.type == "rate_limit_error" and err.code == "queue_full" and "overloaded" in err.message
        for i, text in admitted:
            assert text == alone[i], i
        assert time.monotonic() - t0 < 60
        health = httpx.get(base + "/health").json()
        assert health["num_waiting"] == 0 and health["num_refused"] == CLIENTS - BOUND
        assert health["max_waiting"] == BOUND
        # the queue drained: the next request is admitted
        r = httpx.post(base + "/v1/completions", timeout=60, json={
            "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == alone[0]
        deadline = time.monotonic() + 10
        while engine.has_unfinished() or engine.block_manager.used_ids:
            assert time.monotonic() < deadline, "requests or pages still held"
            time.sleep(0.05)
        assert async_engine.num_waiting == 0


def test_the_default_bound_is_generous_and_zero_means_unbounded():
    assert ServerConfig().max_waiting_queue_length >= 1024
    args = build_parser().parse_args(["serve"])
    assert args.max_waiting_queue_length == 1024
    args = build_parser().parse_args(["serve", "--max-waiting-queue-length", "0"])
    assert args.max_waiting_queue_length == 0


def test_a_steps_outputs_reach_their_streams_in_one_wake_of_the_loop():
    # one call_soon_threadsafe per event loop and step (each is a pipe write
    # waking the loop while the engine thread still needs the GIL), every
    # output in its stream's queue, in order
    from qoqserve.server.streams import Stream, put_all

    loop = asyncio.new_event_loop()
    try:
        calls = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (calls.append(a), real(*a))[1]
        streams = [Stream(loop, asyncio.Queue()) for _ in range(3)]
        put_all([(streams[0], "a0"), (streams[1], "b0"), (streams[0], "a1"), (streams[2], "c0")])
        assert len(calls) == 1
        loop.run_until_complete(asyncio.sleep(0))
        got = [[s.queue.get_nowait() for _ in range(s.queue.qsize())] for s in streams]
        assert got == [["a0", "a1"], ["b0"], ["c0"]]
        put_all([])
        assert len(calls) == 1
    finally:
        loop.close()
