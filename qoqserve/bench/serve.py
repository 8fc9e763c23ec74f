"""`qoqserve bench serve`: a load generator for any OpenAI-compatible server.

Requests stream (SSE); the client clocks every chunk. Per request: TTFT (send
-> first token), inter-token latencies (ITL: gaps between chunks), TPOT
((e2e - TTFT) / (output tokens - 1)) and e2e latency. Output tokens come from
the server's usage when it reports them (stream_options.include_usage), else
the count of content chunks. Load is either a fixed concurrency (a pool of
clients, each sending its next request when the last one ends) or a Poisson
arrival rate, optionally beside clients that send long prompts back to back
(a mixed load: what prefills of long prompts do to the short streams' ITL).

Prompts are seeded random English words, so the same run can be replayed
against another server with the same tokenizer.

The client runs on aiohttp, as vLLM's `vllm bench serve` does: on the
2-core benchmark machine the load generator shares the cores with the
server under test, and httpx's streaming spent ~3x the CPU per token
(2.7 s against 0.9 s for 20,480 streamed tokens: docs/benchmarks.md).
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import aiohttp
from tqdm import tqdm

_WORDS = ("the of and to in is was for on that with as by at from his her an be this have are not "
          "time river city music light water story garden winter market engine letter forest "
          "people number window morning school paper mountain animal family question system "
          "color ocean teacher bridge village kitchen summer history journey language").split()


@dataclass
class LoadConfig:
    base_url: str
    model: str | None = None
    api_key: str | None = None
    endpoint: str = "completions"          # or "chat"
    num_requests: int = 128
    concurrency: int | None = 32           # clients; or None with request_rate
    request_rate: float | None = None      # requests/s, Poisson arrivals
    input_words: int = 75                  # ~100 tokens for this tokenizer family
    input_jitter: float = 0.0              # +- fraction, uniform
    output_len: int = 128
    output_jitter: float = 0.0
    ignore_eos: bool = True
    # what each request samples with (vLLM's bench serve flags); greedy by default
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    logprobs: int | None = None            # each token's logprob and this many most likely
    seed: int = 0
    timeout_s: float = 600.0
    # a mixed load: this many more clients send long prompts back to back while
    # the main load runs; the summary's latencies are the main load's alone
    long_streams: int = 0
    long_input_words: int = 1500           # ~2,000 tokens


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def make_requests(cfg: LoadConfig, long: bool = False) -> list[tuple[str, int]]:
    """The main load's prompts, or (long) those of the long-prompt clients."""
    rng = random.Random(cfg.seed + (7919 if long else 0))
    words_in = cfg.long_input_words if long else cfg.input_words
    out = []
    for i in range(cfg.long_streams * 64 if long else cfg.num_requests):
        n_in = max(1, round(words_in * (1 + rng.uniform(-cfg.input_jitter, cfg.input_jitter))))
        n_out = max(1, round(cfg.output_len * (1 + rng.uniform(-cfg.output_jitter, cfg.output_jitter))))
        words = [rng.choice(_WORDS) for _ in range(n_in)]
        out.append((f"{'Long request' if long else 'Request'} {i}: " + " ".join(words), n_out))
    return out


def _body(cfg: LoadConfig, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": cfg.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    body.update({k: v for k in ("top_p", "top_k", "min_p", "repetition_penalty") if (v := getattr(cfg, k)) is not None})
    if cfg.logprobs is not None:  # the completions field, or chat's pair
        body.update({"logprobs": cfg.logprobs} if cfg.endpoint != "chat" else
                    {"logprobs": True, "top_logprobs": cfg.logprobs})
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # vLLM, llama.cpp and qoqserve all accept it
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def _one(session: aiohttp.ClientSession, cfg: LoadConfig, model: str, prompt: str,
               max_tokens: int) -> RequestResult:
    path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
    res = RequestResult(ok=False)
    start = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with session.post(cfg.base_url.rstrip("/") + path, json=_body(cfg, model, prompt, max_tokens)) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                return res
            async for line in r.content:  # one SSE line at a time
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("usage"):
                    res.prompt_tokens = msg["usage"].get("prompt_tokens", 0)
                    res.output_tokens = msg["usage"].get("completion_tokens", 0)
                for choice in msg.get("choices") or []:
                    text = choice.get("text") if cfg.endpoint != "chat" else (choice.get("delta") or {}).get("content")
                    if not text:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
        res.e2e = time.perf_counter() - start
        res.output_tokens = res.output_tokens or chunks
        res.ok = last is not None
        if not res.ok:
            res.error = "no tokens received"
    except Exception as e:  # a failed request is reported, not fatal to the run
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _run(cfg: LoadConfig, progress: bool) -> tuple[list[RequestResult], float, str]:
    requests = make_requests(cfg)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    # a connection per request: llama.cpp's server closes kept-alive ones, and
    # aiohttp would send the next request into the closed socket
    connector = aiohttp.TCPConnector(limit=max((cfg.concurrency or 0) + cfg.long_streams, 256), force_close=True)
    # per read, as httpx's was: a long stream may take longer than timeout_s in all
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.timeout_s, sock_read=cfg.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        model = cfg.model
        if model is None:
            async with session.get(cfg.base_url.rstrip("/") + "/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
        bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress)
        results: list[RequestResult | None] = [None] * len(requests)

        async def run_one(i):
            results[i] = await _one(session, cfg, model, *requests[i])
            bar.update(1)

        long_queue = iter(make_requests(cfg, long=True))

        async def long_client():  # until cancelled when the main load is done
            for prompt, n_out in long_queue:
                await _one(session, cfg, model, prompt, n_out)
        background = [asyncio.create_task(long_client()) for _ in range(cfg.long_streams)]
        if background:  # the main load starts once the long prompts are being served
            await asyncio.sleep(0.5)
        start = time.perf_counter()
        if cfg.request_rate:
            rng = random.Random(cfg.seed + 1)
            tasks = []
            for i in range(len(requests)):
                tasks.append(asyncio.create_task(run_one(i)))
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
            await asyncio.gather(*tasks)
        else:
            queue = iter(range(len(requests)))

            async def worker():
                for i in queue:
                    await run_one(i)
            await asyncio.gather(*(worker() for _ in range(cfg.concurrency or 1)))
        wall = time.perf_counter() - start
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        bar.close()
    return results, wall, model


def _pcts(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    v = sorted(values)

    def pct(p):
        return v[min(len(v) - 1, round(p / 100 * (len(v) - 1)))]
    # max: a single stall (a full garbage collection, a preemption) hides under p99
    return {"mean": statistics.fmean(v), "p50": pct(50), "p90": pct(90), "p99": pct(99), "max": v[-1]}


def summarize(results: list[RequestResult], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "wall_s": wall, "output_tokens": out_tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tok_per_s": out_tokens / wall if wall else 0.0,
        "req_per_s": len(ok) / wall if wall else 0.0,
        "ttft_s": _pcts([r.ttft for r in ok]),
        "tpot_s": _pcts([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": _pcts([x for r in ok for x in r.itl]),
        "e2e_s": _pcts([r.e2e for r in ok]),
    }


def run_load(cfg: LoadConfig, progress: bool = True) -> dict:
    results, wall, model = asyncio.run(_run(cfg, progress))
    summary = summarize(results, wall)
    summary["model"] = model
    summary["config"] = asdict(cfg)
    summary["config"].pop("api_key", None)
    return summary


def format_summary(s: dict) -> str:
    def ms(d, k):
        return "-" if d[k] is None else f"{d[k] * 1e3:.1f}"
    lines = [f"completed {s['completed']}/{s['requests']} in {s['wall_s']:.1f}s: "
             f"{s['output_tok_per_s']:.1f} output tok/s, {s['req_per_s']:.2f} req/s "
             f"(prompt tokens {s['prompt_tokens']}, output tokens {s['output_tokens']})"]
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        d = s[name]
        lines.append(f"  {name[:-2].upper():<5} ms  mean {ms(d, 'mean'):>8}  p50 {ms(d, 'p50'):>8}  "
                     f"p90 {ms(d, 'p90'):>8}  p99 {ms(d, 'p99'):>8}  max {ms(d, 'max'):>8}")
    if s["errors"]:
        lines.append(f"  errors: {s['errors']}")
    return "\n".join(lines)
