"""Over HTTP: a request a step fails on gets a server_error and nobody else
notices; a fault nobody can be blamed for fails its step's requests, the
server goes on and /health says "degraded".

The server runs in this process (over the session's offline engine) so the
test can inject faults into its engine; see conftest.PoisonedSampler.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from conftest import FlakyRunner, PoisonedSampler, in_process_server

from qoqserve.engine.isolation import StepIsolation
from qoqserve.sampling_params import SamplingParams
from qoqserve.server.responses import ErrorResponse

PROMPTS = ["The capital of France is", "Water boils at", "My favourite colour is",
           "The quick brown fox"]
POISON = "Tell me a story about a dragon"
N = 12


@pytest.fixture(scope="module")
def live(reference_llm, alone):
    """(base url, engine); the engine is the server thread's until teardown, so
    `alone` runs first. One step at a time: the faults are injected into the
    runner's run and the sampler, which a decode burst does not call."""
    sched = reference_llm.engine.config.scheduler
    steps, sched.num_scheduler_steps = sched.num_scheduler_steps, 1
    with in_process_server(reference_llm.engine) as (base, _):
        yield base, reference_llm.engine
    sched.num_scheduler_steps = steps


@pytest.fixture(scope="module")
def alone(reference_llm):
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    return {p: reference_llm.generate(p, params)[0].text for p in PROMPTS}


async def stream(client, base, prompt, max_tokens=N):
    """(text received, finish_reason, error body or None, saw [DONE])."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, reason, error, done = "", None, None, False
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                if "error" in data:
                    error = data
                else:
                    text += data["choices"][0]["text"]
                    reason = data["choices"][0]["finish_reason"] or reason
    return text, reason, error, done


def wait_idle(engine, timeout=10.0):
    deadline = time.monotonic() + timeout
    while engine.has_unfinished() or engine.block_manager.used_ids:
        assert time.monotonic() < deadline, "requests or pages still held"
        time.sleep(0.05)


def test_a_poisoned_request_fails_alone_while_four_streams_finish(live, alone, monkeypatch):
    base, engine = live
    poison_ids = engine.tokenizer.encode(POISON)
    sampler = PoisonedSampler(engine.runner.sampler,
                              lambda r: r.token_ids[:r.num_prompt_tokens] == poison_ids
                              and r.num_output_tokens >= 3)
    monkeypatch.setattr(engine.runner, "sampler", sampler)
    health0 = httpx.get(base + "/health").json()

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"prompt": POISON, "max_tokens": N, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(*(stream(client, base, p) for p in PROMPTS),
                                        stream(client, base, POISON),
                                        client.post(base + "/v1/completions", json=body))

    *streams, bad_stream, bad_plain = asyncio.run(run())
    for (text, reason, error, done), p in zip(streams, PROMPTS):
        assert (text, reason, error, done) == (alone[p], "length", None, True)
    text, reason, error, done = bad_stream
    assert done and reason is None and text  # its first tokens were streamed, then the error
    assert error["error"]["type"] == "server_error" and "injected fault" in error["error"]["message"]
    assert bad_plain.status_code == 500
    err = ErrorResponse.model_validate(bad_plain.json()).error
    assert err.type == "server_error" and "injected fault" in err.message
    assert max(sampler.failed_batch_sizes) > 1  # it failed in a step shared with others
    wait_idle(engine)  # every page back, the poisoned requests' included
    health = httpx.get(base + "/health")
    assert health.status_code == 200 and health.json()["status"] == health0["status"]
    assert health.json()["request_faults"] - health0["request_faults"] == 2


def test_an_unpinnable_fault_fails_its_step_and_the_server_goes_on(live, alone, monkeypatch):
    base, engine = live
    runner = FlakyRunner(engine.runner)
    monkeypatch.setattr(engine, "isolation", StepIsolation(runner))
    before = httpx.get(base + "/health").json()

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(stream(client, base, p, max_tokens=200)) for p in PROMPTS[:2]]
            while not all(s.num_output_tokens >= 2 for s in list(engine.scheduler.running)) \
                    or len(engine.scheduler.running) < 2:
                await asyncio.sleep(0.01)
            runner.failures = 10**6  # from now on every run fails, alone or together
            results = await asyncio.gather(*tasks)
            runner.failures = 0
            return results

    for text, reason, error, done in asyncio.run(run()):
        assert done and text and reason is None
        assert error["error"]["type"] == "server_error" and "injected engine fault" in error["error"]["message"]
    wait_idle(engine)
    health = httpx.get(base + "/health")
    assert health.status_code == 200
    assert health.json()["status"] == "degraded"
    assert health.json()["engine_faults"] - before["engine_faults"] == 1
    assert "injected engine fault" in health.json()["last_engine_fault"]
    r = httpx.post(base + "/v1/completions", timeout=60, json={
        "prompt": PROMPTS[2], "max_tokens": N, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == alone[PROMPTS[2]]
