"""`qoqserve bench serve --soak SECONDS`: a long mixed load that checks, not times.

N clients send, back to back for SECONDS: valid greedy streams (most), garbage
(malformed bodies that must get a 4xx) and streams they hang up on after a
chunk or two. Every valid answer is compared with the same prompt's output
taken alone before the load, so a request that was lost, cut short or got
someone else's tokens counts as an error of its kind, not as a slow request.
Every --soak-interval seconds a row reports the errors so far, the interval's
p99 latency, the server's RSS (/proc/PID/status with --server-pid, else
/health's rss_bytes) and its KV pages in use. At the end: pages still held
once the server is idle (leaked), and RSS growth from the end of warm-up
(the first part of the run, when pools and allocator arenas fill) to the end.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import httpx

from qoqserve.bench.serve import _pcts

# malformed requests, each of which a conforming server must refuse with a 4xx
GARBAGE: list[bytes] = [
    b"", b"{", b"[]", b"null", b'"prompt"', b'{"prompt": NaN}', b"\xff\xfe\x00",
    b'{"a":' * 200 + b"1" + b"}" * 200,
    json.dumps({"prompt": "hi", "max_tokens": -1}).encode(),
    json.dumps({"prompt": "hi", "max_tokens": "many"}).encode(),
    json.dumps({"prompt": "hi", "seed": 2**70}).encode(),
    json.dumps({"prompt": "hi", "temperature": -3}).encode(),
    json.dumps({"prompt": "hi", "n": 0}).encode(),
    json.dumps({"prompt": ["hi", ""], "n": 2}).encode(),
    json.dumps({"prompt": "", "max_tokens": 4}).encode(),
    json.dumps({"prompt": [10**9], "max_tokens": 4}).encode(),
    json.dumps({"prompt": "hi", "model": "no-such-model"}).encode(),
    b'{"prompt": "\\ud800", "max_tokens": 4}',
    json.dumps({"prompt": "hi", "stop": [1, 2]}).encode(),
]


@dataclass
class SoakConfig:
    base_url: str
    duration_s: float = 300.0
    concurrency: int = 64
    garbage_frac: float = 0.1
    disconnect_frac: float = 0.1
    output_len: int = 16
    num_prompts: int = 16          # distinct prompts (each one's reference output is taken alone first)
    interval_s: float = 10.0
    warmup_frac: float = 0.2       # RSS growth is measured from the end of this share of the run
    server_pid: int | None = None
    api_key: str | None = None
    model: str | None = None
    seed: int = 0
    timeout_s: float = 120.0


@dataclass
class SoakState:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("valid_ok", "garbage_4xx", "disconnects", "lost", "corrupted", "truncated",
         "garbage_not_4xx", "overloaded_429"), 0))
    latencies: list[float] = field(default_factory=list)   # this interval's valid e2e
    examples: dict[str, str] = field(default_factory=dict)  # first message of each error kind
    rows: list[dict] = field(default_factory=list)

    def note(self, kind: str, detail: str = "") -> None:
        self.counts[kind] += 1
        if detail and kind not in self.examples:
            self.examples[kind] = detail[:300]


ERROR_KINDS = ("lost", "corrupted", "truncated", "garbage_not_4xx")


def classify(expected: str, text: str | None, done: bool, reason: str | None) -> str:
    """A valid stream's outcome: valid_ok, or the kind of error it is."""
    if text is None:
        return "lost"
    if not done or reason != "length":
        return "truncated"
    return "valid_ok" if text == expected else "corrupted"


def _body(cfg: SoakConfig, model: str, prompt: str) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": cfg.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True}


async def _stream(client, cfg, model, prompt, hang_up_after: int | None = None):
    """(text, saw [DONE], finish_reason, error); text None when not served."""
    text, done, reason = "", False, None
    async with client.stream("POST", "/v1/completions", json=_body(cfg, model, prompt)) as r:
        if r.status_code != 200:
            return None, False, None, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
        chunks = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            msg = json.loads(line[6:])
            if "error" in msg:
                return text, False, None, f"error event: {msg['error'].get('message')}"
            choice = msg["choices"][0]
            text += choice["text"]
            reason = choice["finish_reason"] or reason
            chunks += 1
            if hang_up_after is not None and chunks >= hang_up_after:
                return text, False, None, ""  # leaving the block closes the connection
    return text, done, reason, ""


async def _client(client, cfg, model, prompts, expected, state, rng, stop_at):
    while time.monotonic() < stop_at:
        roll = rng.random()
        if roll < cfg.garbage_frac:
            body = rng.choice(GARBAGE)
            try:
                r = await client.post("/v1/completions", content=body,
                                      headers={"Content-Type": "application/json"})
                ok = 400 <= r.status_code < 500 and "error" in r.json()
                state.note("garbage_4xx" if ok else "garbage_not_4xx", f"{body[:60]!r} -> {r.status_code}")
            except Exception as e:
                state.note("garbage_not_4xx", f"{body[:60]!r} -> {type(e).__name__}: {e}")
            continue
        i = rng.randrange(len(prompts))
        if roll < cfg.garbage_frac + cfg.disconnect_frac:
            try:
                await _stream(client, cfg, model, prompts[i], hang_up_after=rng.randint(1, 2))
            except Exception:
                pass  # a hang-up is allowed to fail on our side
            state.note("disconnects")
            continue
        start = time.monotonic()
        try:
            text, done, reason, err = await _stream(client, cfg, model, prompts[i])
        except Exception as e:
            text, done, reason, err = None, False, None, f"{type(e).__name__}: {e}"
        if err.startswith("HTTP 429"):
            state.note("overloaded_429", err)  # the server shedding load: not a lost request
            await asyncio.sleep(0.5)
            continue
        kind = classify(expected[i], text, done, reason)
        state.note(kind, "" if kind == "valid_ok" else err or f"prompt {i}: got {text!r}, "
                   f"expected {expected[i]!r}")
        if kind == "valid_ok":
            state.latencies.append(time.monotonic() - start)


async def _server_view(client, cfg) -> dict:
    """RSS and KV pages now: /health, with RSS from /proc when the PID is given."""
    h = (await client.get("/health")).json()
    rss = h.get("rss_bytes")
    if cfg.server_pid is not None:
        with open(f"/proc/{cfg.server_pid}/status") as f:
            rss = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))
    total, free = h.get("kv_total_blocks"), h.get("kv_free_blocks")
    used = None if total is None or free is None else total - free
    return {"rss_bytes": rss, "kv_used_blocks": used, "kv_total_blocks": total,
            "num_running": h.get("num_running")}


async def _monitor(client, cfg, state, t0, stop_at, progress):
    while True:
        # a row every interval, and a last one when the load stops
        await asyncio.sleep(max(0.05, min(cfg.interval_s, stop_at - time.monotonic())))
        lat, state.latencies = state.latencies, []
        row = {"t_s": round(time.monotonic() - t0, 1), **state.counts,
               "p99_s": _pcts(lat)["p99"], **await _server_view(client, cfg)}
        state.rows.append(row)
        if progress:
            print(format_row(row), flush=True)
        if time.monotonic() >= stop_at:
            return


async def _run(cfg: SoakConfig, progress: bool) -> dict:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency + 8)
    async with httpx.AsyncClient(base_url=cfg.base_url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(cfg.timeout_s)) as client:
        model = cfg.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        rng = random.Random(cfg.seed)
        words = "river city music light water story garden winter market engine letter forest".split()
        prompts = [f"Soak {i}: " + " ".join(rng.choice(words) for _ in range(12)) for i in range(cfg.num_prompts)]
        expected = []
        for p in prompts:  # each prompt alone, before the load: what every later answer must equal
            text, done, reason, err = await _stream(client, cfg, model, p)
            if err or not done:
                raise RuntimeError(f"the reference pass failed: {err or 'no [DONE]'}")
            expected.append(text)
        state = SoakState()
        t0 = time.monotonic()
        stop_at = t0 + cfg.duration_s
        monitor = asyncio.create_task(_monitor(client, cfg, state, t0, stop_at, progress))
        await asyncio.gather(*(_client(client, cfg, model, prompts, expected, state,
                                       random.Random(cfg.seed * 1000 + c), stop_at)
                               for c in range(cfg.concurrency)))
        await monitor
        # idle again: every page must come back (hang-ups included) within a few seconds
        deadline = time.monotonic() + 10
        while True:
            view = await _server_view(client, cfg)
            if view["kv_used_blocks"] in (0, None) and not view["num_running"] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
    return _summary(cfg, state, view)


def _summary(cfg: SoakConfig, state: SoakState, final: dict) -> dict:
    rows = state.rows
    base_row = rows[min(len(rows) - 1, int(len(rows) * cfg.warmup_frac))] if rows else {}
    base, end = base_row.get("rss_bytes"), final["rss_bytes"]
    growth = (end - base) / base if base and end else None
    p99s = [r["p99_s"] for r in rows if r["p99_s"] is not None]
    return {"config": {k: v for k, v in asdict(cfg).items() if k != "api_key"}, "counts": state.counts,
            "errors": sum(state.counts[k] for k in ERROR_KINDS), "error_examples": state.examples,
            "leaked_blocks": final["kv_used_blocks"], "rss_start_bytes": base, "rss_end_bytes": end,
            "rss_growth": growth, "p99_s_max": max(p99s) if p99s else None, "rows": rows}


def run_soak(cfg: SoakConfig, progress: bool = True) -> dict:
    return asyncio.run(_run(cfg, progress))


def format_row(r: dict) -> str:
    p99 = "-" if r["p99_s"] is None else f"{r['p99_s'] * 1e3:.0f}ms"
    rss = "-" if r["rss_bytes"] is None else f"{r['rss_bytes'] / 2**20:.1f}MiB"
    errors = sum(r[k] for k in ERROR_KINDS)
    return (f"t={r['t_s']:>6}s ok {r['valid_ok']:>6} garbage->4xx {r['garbage_4xx']:>5} "
            f"hang-ups {r['disconnects']:>5} 429 {r['overloaded_429']:>4} ERRORS {errors} "
            f"(lost {r['lost']} corrupted {r['corrupted']} truncated {r['truncated']} "
            f"garbage-not-4xx {r['garbage_not_4xx']})  p99 {p99}  RSS {rss}  "
            f"KV {r['kv_used_blocks']}/{r['kv_total_blocks']}")


def format_summary(s: dict) -> str:
    growth = "-" if s["rss_growth"] is None else f"{s['rss_growth'] * 100:+.2f}%"
    p99 = "-" if s["p99_s_max"] is None else f"{s['p99_s_max'] * 1e3:.0f}ms"
    lines = [f"soak {s['config']['duration_s']:.0f}s, {s['config']['concurrency']} clients: "
             f"{s['errors']} errors, {s['leaked_blocks']} leaked pages, RSS growth {growth} "
             f"(from the end of warm-up), worst interval p99 {p99}",
             f"  counts: {s['counts']}"]
    for kind, msg in s["error_examples"].items():
        if kind in ERROR_KINDS:
            lines.append(f"  first {kind}: {msg}")
    return "\n".join(lines)
