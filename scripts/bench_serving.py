#!/usr/bin/env python
"""Serving benchmark, ours and peers, one after another in one run, same load.

Each system is started, waited for (/v1/models), driven by `qoqserve bench
serve` at each concurrency of the sweep, and stopped before the next one
starts, so no two compete for the CPU. Peers are optional: pass the command
that starts each (installed as docs/benchmarks.md says; nothing of theirs is
in this repository). Results: one JSON per system plus a markdown table and a
latency-vs-load plot in --out.

    python scripts/bench_serving.py --out docs/benchmarks/serving_cpu \
        --peer "llama.cpp=llama-server -m MODEL.gguf --port {port} -np 32 -c 16384 -t 2" \
        --peer "vLLM-CPU=vllm serve HF_DIR --port {port} --dtype bfloat16"

--vllm-bench "VLLM_VENV/bin/python scripts/vllm_bench_serve.py" (with
--vllm-bench-tokenizer HF_DIR) also drives every system, while it is up and
after our own sweep, with vLLM's load tool at the same concurrencies and
request counts (its random dataset: --vllm-bench-input-len tokens in,
--output-len out, EOS ignored); its result JSONs go to OUT/vllm_bench/ and
its figures into a second table.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import httpx

from qoqserve.bench.plots import plot_latency_vs_load
from qoqserve.bench.serve import LoadConfig, format_summary, run_load

# plain `serve` (the embedded model as QoQ W4A8KV4, every default) and the
# full-precision model in bf16
OURS = {
    "qoqserve W4A8KV4 (plain serve)": "{py} -m qoqserve.cli.main serve --port {port}",
    "qoqserve BF16": "{py} -m qoqserve.cli.main serve default --dtype bfloat16 --port {port}",
}


def wait_up(base: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server at {base} not up after {timeout}s")


def same_priority(pid: int) -> None:
    """Give a system under test the benchmark's own scheduling weight. Each
    is started in a session of its own (to be stopped as a group), and Linux
    weighs sessions against each other (autogroups), so `nice` on the
    benchmark alone would not reach it; on a shared machine run the benchmark
    with its autogroup at a high priority (echo -20 > /proc/self/autogroup)."""
    try:
        with open("/proc/self/autogroup") as f:
            nice = f.read().split()[-1]
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(nice)
    except (OSError, IndexError):
        pass  # no autogroups here, or not permitted: nothing to match


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench_system(name: str, cmd: str, args) -> list[dict]:
    port = args.port
    base = f"http://127.0.0.1:{port}"
    log = open(os.path.join(args.out, f"{slug(name)}.log"), "w")
    proc = subprocess.Popen(shlex.split(cmd.format(port=port, py=sys.executable)), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    same_priority(proc.pid)
    summaries = []
    try:
        wait_up(base, proc, args.startup_timeout)
        # warm-up: compiled graphs (batch 1 and batch > 1), caches, first allocations;
        # prompts of another seed, so that no measured prompt is in a prefix cache
        for n, c in ((2, 1), (8, 8)):
            run_load(LoadConfig(base_url=base, num_requests=n, concurrency=c, output_len=8,
                                input_words=args.input_words, seed=args.seed + 1000), progress=False)
        for c in args.concurrency:
            cfg = LoadConfig(base_url=base, num_requests=num_requests(args, c), concurrency=c,
                             input_words=args.input_words,
                             output_len=args.output_len, seed=args.seed, long_streams=args.long_streams,
                             long_input_words=args.long_input_words, temperature=args.temperature,
                             top_p=args.top_p, repetition_penalty=args.repetition_penalty, logprobs=args.logprobs)
            s = run_load(cfg, progress=False)
            s["system"] = name
            s["command"] = cmd
            print(f"## {name}, {c} concurrent streams\n{format_summary(s)}", flush=True)
            summaries.append(s)
        if args.vllm_bench:
            vllm_bench(name, base, args)
    finally:
        stop(proc)
        log.close()
    with open(os.path.join(args.out, f"{slug(name)}.json"), "w") as f:
        json.dump(summaries, f, indent=2)
    return summaries


def num_requests(args, concurrency: int) -> int:
    """Requests of one sweep point, for our load tool and vLLM's alike."""
    return max(args.requests_per_stream * concurrency, args.min_requests)


def vllm_bench(name: str, base: str, args) -> None:
    """vLLM's own load tool against the server that is up, one run per concurrency."""
    model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
    out = os.path.join(args.out, "vllm_bench")
    os.makedirs(out, exist_ok=True)
    for c in args.concurrency:
        cmd = shlex.split(args.vllm_bench) + [
            "--backend", "openai", "--base-url", base, "--endpoint", "/v1/completions", "--model", model,
            "--tokenizer", args.vllm_bench_tokenizer, "--dataset-name", "random",
            "--random-input-len", str(args.vllm_bench_input_len), "--random-output-len", str(args.output_len),
            "--random-range-ratio", "0", "--num-prompts", str(num_requests(args, c)), "--max-concurrency", str(c),
            "--ignore-eos", "--temperature", "0", "--num-warmups", str(min(c, 8)), "--seed", str(args.seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", out, "--result-filename", f"{slug(name)}_c{c}.json"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        print(f"## {name}, vllm bench serve, {c} concurrent streams (rc {done.returncode})\n"
              + "\n".join(done.stdout.splitlines()[-30:]), flush=True)
        if done.returncode:
            print(done.stderr[-3000:], flush=True)


def vllm_table(names, out: str, concurrency) -> str:
    lines = ["| system | streams | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms | "
             "completed / failed |", "| --- | ---: | ---: | --- | --- | --- | --- |"]
    for name in names:
        for c in concurrency:
            path = os.path.join(out, "vllm_bench", f"{slug(name)}_c{c}.json")
            if not os.path.exists(path):
                continue
            with open(path) as f:
                r = json.load(f)
            pair = " / ".join
            lines.append(f"| {name} | {c} | {r['output_throughput']:.1f} | "
                         f"{pair(f'{r[k]:.0f}' for k in ('median_ttft_ms', 'p99_ttft_ms'))} | "
                         f"{pair(f'{r[k]:.1f}' for k in ('median_tpot_ms', 'p99_tpot_ms'))} | "
                         f"{pair(f'{r[k]:.1f}' for k in ('median_itl_ms', 'p99_itl_ms'))} | "
                         f"{r['completed']} / {r.get('failed', 0)} |")
    return "\n".join(lines)


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")


def table(results: dict[str, list[dict]], concurrency: int) -> str:
    lines = [f"| system | {concurrency} streams: output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | "
             "single stream TPOT p50 ms | failed |", "| --- | --- | --- | --- | --- | --- |"]
    for name, runs in results.items():
        at = next((s for s in runs if s["config"]["concurrency"] == concurrency), None)
        one = next((s for s in runs if s["config"]["concurrency"] == 1), None)
        if at is None:
            continue
        lines.append(
            f"| {name} | {at['output_tok_per_s']:.1f} | {at['ttft_s']['p50'] * 1e3:.0f} / "
            f"{at['ttft_s']['p99'] * 1e3:.0f} | {at['tpot_s']['p50'] * 1e3:.1f} / {at['tpot_s']['p99'] * 1e3:.1f} | "
            f"{one['tpot_s']['p50'] * 1e3:.1f} | {at['failed']} |" if one else
            f"| {name} | {at['output_tok_per_s']:.1f} | - | - | - | {at['failed']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--peer", action="append", default=[], help="NAME=COMMAND with {port}")
    ap.add_argument("--only", nargs="*", default=None, help="run only these systems")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests-per-stream", type=int, default=3)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--input-words", type=int, default=75)
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's (default 0: greedy)")
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--repetition-penalty", type=float, default=None)
    ap.add_argument("--logprobs", type=int, default=None, help="ask each token's logprob and this many most likely")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long-streams", type=int, default=0,
                    help="a mixed load: clients sending long prompts beside each sweep's streams")
    ap.add_argument("--long-input-words", type=int, default=1500)
    ap.add_argument("--vllm-bench", default=None,
                    help="command running `vllm bench serve`, e.g. 'VENV/bin/python scripts/vllm_bench_serve.py'")
    ap.add_argument("--vllm-bench-tokenizer", default=None, help="HF dir of the served model's tokenizer")
    ap.add_argument("--vllm-bench-input-len", type=int, default=80, help="prompt tokens of its random dataset")
    args = ap.parse_args()
    if args.vllm_bench and not args.vllm_bench_tokenizer:
        ap.error("--vllm-bench needs --vllm-bench-tokenizer")
    os.makedirs(args.out, exist_ok=True)
    systems = dict(OURS)
    for item in args.peer:
        name, _, cmd = item.partition("=")
        systems[name] = cmd
    if args.only:
        systems = {k: v for k, v in systems.items() if k in args.only}
    results = {}
    for name, cmd in systems.items():
        try:
            results[name] = bench_system(name, cmd, args)
        except Exception as e:  # one system failing must not lose the others' numbers
            print(f"## {name}: FAILED: {e}", flush=True)
    # earlier runs of systems not rerun this time are not mixed in: one run, one table
    md = table(results, max(args.concurrency))
    if args.vllm_bench:
        md += "\n\n`vllm bench serve` (vLLM's load tool, random prompts):\n\n" + vllm_table(
            results, args.out, args.concurrency)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    sampling = (f", temperature {args.temperature:g}" if args.temperature else "") + (
        f" top_p {args.top_p:g}" if args.top_p is not None else "") + (
        f", repetition_penalty {args.repetition_penalty:g}" if args.repetition_penalty is not None else "") + (
        f", logprobs {args.logprobs}" if args.logprobs is not None else "")
    title = f"{args.input_words} words in, {args.output_len} tokens out" + sampling + (
        f", beside {args.long_streams} streams of {args.long_input_words}-word prompts" if args.long_streams else "")
    plot_latency_vs_load(results, os.path.join(args.out, "latency_vs_load.png"), title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
