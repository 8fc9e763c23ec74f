"""Under load and hang-ups: nothing lost, nothing hung, every page back, memory flat."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import psutil
import pytest
from conftest import SERVER_ARGS, ServerProcess

from qoqserve.sampling_params import SamplingParams

KEY = {"Authorization": "Bearer test-key"}
PROMPTS = [f"Here is what I know about {topic}:" for topic in (
    "rivers", "the moon", "bread", "winter", "trains", "bees", "libraries", "tea")]
MAX_TOKENS = 12


def wait_idle(server, timeout: float = 10.0) -> dict:
    """Metrics once no request runs or waits; fails if pages are still held after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
                and m["qoqserve:kv_cache_free_blocks"] == m["qoqserve:kv_cache_total_blocks"]):
            return m
        assert time.monotonic() < deadline, f"server not idle after {timeout}s: {m}"
        time.sleep(0.1)


def assert_still_serving(server, reference_llm) -> None:
    """After an ordeal: a normal request gets the reference greedy text, then
    the server goes idle with every page free and reports itself healthy."""
    r = httpx.post(server.base + "/v1/completions", headers=KEY, timeout=60,
                   json={"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
    ref = reference_llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=8))[0]
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.text
    wait_idle(server)
    assert httpx.get(server.base + "/health").json()["status"] == "ok"


async def _stream_one(client: httpx.AsyncClient, base: str, i: int, hang_up_after: int | None):
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True}
    text, chunks, done, reason = "", 0, False, None
    async with client.stream("POST", base + "/v1/completions", json=body, headers=KEY) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            reason = choice["finish_reason"] or reason
            chunks += 1
            if hang_up_after is not None and chunks >= hang_up_after:
                return i, None, None  # leaving the block closes the connection mid-stream
    assert done, f"request {i} ended without [DONE]"
    return i, text, reason


async def _round(base: str, n: int, concurrency: int):
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        async def one(i):
            async with sem:
                return await _stream_one(client, base, i, hang_up_after=2 if i % 7 == 3 else None)
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), timeout=600)


def test_64_streaming_clients_128_requests_two_rounds(server, reference_llm):
    refs = [o.text for o in reference_llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]
    asyncio.run(_round(server.base, 16, 16))  # warm-up: first-use allocations are not a leak
    wait_idle(server)
    proc = psutil.Process(server.proc.pid)
    rss = []
    for _ in range(2):
        results = asyncio.run(_round(server.base, 128, 64))
        assert len(results) == 128
        completed = [(i, text, reason) for i, text, reason in results if text is not None]
        hung_up = {i for i, text, _ in results if text is None}
        assert hung_up <= {i for i in range(128) if i % 7 == 3} and len(hung_up) > 15
        assert len(completed) + len(hung_up) == 128
        for i, text, reason in completed:
            assert text == refs[i % len(PROMPTS)], f"request {i} differs from the offline engine"
            assert reason in ("length", "stop")
        wait_idle(server)
        rss.append(proc.memory_info().rss)
    growth = rss[1] - rss[0]
    assert growth < 0.05 * rss[0], f"RSS grew {growth / 2**20:.1f} MiB between identical rounds"


def test_client_hanging_up_mid_stream_frees_its_pages_at_once(server):
    body = {"prompt": "Tell me a very long story.", "max_tokens": 290, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, headers=KEY, timeout=60) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break
        m = server.metrics()
        assert m["vllm:num_requests_running"] == 1 and m["vllm:kv_cache_usage_perc"] > 0
    t0 = time.monotonic()
    m = wait_idle(server, timeout=5.0)
    assert time.monotonic() - t0 < 5.0
    assert m["vllm:kv_cache_usage_perc"] == 0


def test_non_streaming_client_timing_out_aborts_its_request(server):
    body = {"prompt": "Tell me a very long story.", "max_tokens": 290, "temperature": 0, "ignore_eos": True}
    before = server.metrics()["vllm:generation_tokens_total"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base + "/v1/completions", json=body, headers=KEY, timeout=1.5)
    wait_idle(server, timeout=5.0)
    generated = server.metrics()["vllm:generation_tokens_total"] - before
    assert generated < 290, "the request ran to the end although its client had gone"


def test_sigterm_finishes_short_requests_and_aborts_long_ones(default_gguf_path):
    # 290 tokens (the limit SERVER_ARGS allows) take ~7 s here, the grace period 2 s
    srv = ServerProcess([default_gguf_path, *SERVER_ARGS, "--graceful-shutdown-s", "2"])

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            streaming = asyncio.Event()

            async def stream(max_tokens):
                body = {"prompt": "Count slowly:", "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True}
                n, finish, done = 0, None, False
                async with client.stream("POST", srv.base + "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            n += 1
                            streaming.set()
                            finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
                        done = line == "data: [DONE]" or done
                assert done, "the stream was cut without [DONE]"
                return n, finish

            long = asyncio.create_task(stream(290))
            await streaming.wait()
            short = asyncio.create_task(stream(10))
            await asyncio.sleep(0.1)  # the short one is admitted
            srv.proc.send_signal(signal.SIGTERM)
            return await short, await long

    t0 = time.monotonic()
    (n_short, finish_short), (n_long, finish_long) = asyncio.run(run())
    rc = srv.proc.wait(30)
    assert rc == 0, srv.output()
    assert (n_short, finish_short) == (10, "length")  # in flight at SIGTERM, finished cleanly
    assert n_long < 290 and finish_long == "abort"     # ended cleanly after the grace period
    assert time.monotonic() - t0 < 40
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.base + "/health", timeout=2)
