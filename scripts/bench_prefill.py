#!/usr/bin/env python
"""Prefill throughput on CPU: qoqserve's engines beside llama.cpp's
`llama-bench -p 512` (and other -p with --llama-prompts), in one run, taking turns round by round so that load
from other jobs hits every contestant alike.

Each qoqserve row prefills B x L random-token prompts (prefix cache off, one
token sampled, the default step budget), best round of --rounds. "before"
rows run the same engine with the C prefill attention switched off (the
attention layer then falls back to per-sequence fp64 torch SDPA, the path
before paged_prefill.c), so before/after is measured side by side.

    python scripts/bench_prefill.py --gguf F16=/path/f16.gguf --gguf Q4_0=/path/q4_0.gguf \
        --llama-bench /path/llama-bench > docs/benchmarks/prefill_cpu.txt
"""
import argparse
import contextlib
import json
import platform
import subprocess
import time

import torch

from qoqserve.bench.offline import make_prompts
from qoqserve.bench.precisions import engine_kwargs, get_precision, model_for
from qoqserve.layers.attention_backends import CpuAttention
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams


def prefill_seconds(llm, batch: int, length: int, seed: int) -> float:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i, p in enumerate(make_prompts(batch, length, engine.arch.vocab_size, seed=seed)):
        engine.add_request(f"prefill-{seed}-{i}", p, params)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def llama_bench(binary: str, gguf: str, n_prompt: int, threads: int) -> float:
    """llama-bench's pp tok/s (its own mean of 5 repetitions)."""
    out = subprocess.run([binary, "-m", gguf, "-p", str(n_prompt), "-n", "0", "-t", str(threads), "-o", "json"],
                         capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


@contextlib.contextmanager
def c_prefill_off():
    """The engine's prefill attention as it was before paged_prefill.c."""
    saved = CpuAttention.prefill
    CpuAttention.prefill = lambda *a, **k: None
    try:
        yield
    finally:
        CpuAttention.prefill = saved


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precisions", nargs="+", default=["w4a8kv4", "bf16"])
    ap.add_argument("--shapes", nargs="+", default=["1x1024", "8x1024"], help="BxL")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", action="store_true", help="also the fp64-SDPA prefill attention rows")
    ap.add_argument("--gguf", action="append", default=[], help="NAME=PATH, a model for llama-bench")
    ap.add_argument("--llama-bench", default=None, help="path of llama-bench")
    ap.add_argument("--llama-prompts", nargs="+", type=int, default=[512],
                    help="llama-bench prompt lengths (-p), each its own row")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    threads = torch.get_num_threads()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    print(f"# {platform.processor() or platform.machine()}, {threads} threads, torch {torch.__version__}")
    pp = ",".join(str(n) for n in args.llama_prompts)
    print(f"# qoqserve: prefix cache off, default step budget; llama-bench -p {pp} -n 0 -t {threads}")
    engines = {}
    for name in args.precisions:
        p = get_precision(name)
        engines[name] = LLM(model_for(p, None), enable_prefix_caching=False,
                            max_num_seqs=max(b for b, _ in shapes), **engine_kwargs(p, "cpu"))
    variants = [(n, False) for n in engines] + ([(n, True) for n in engines] if args.before else [])
    best: dict = {}
    for name, before in variants:  # warm-up: kernels built, pages touched
        with (c_prefill_off() if before else contextlib.nullcontext()):
            prefill_seconds(engines[name], 1, 256, seed=999)
    for r in range(args.rounds):
        for name, before in variants:
            for b, n in shapes:
                with (c_prefill_off() if before else contextlib.nullcontext()):
                    dt = prefill_seconds(engines[name], b, n, seed=1000 * r + b)
                key = (f"qoqserve {name}" + (" (before: fp64 SDPA prefill)" if before else ""), f"{b}x{n}")
                best[key] = min(best.get(key, float("inf")), dt / (b * n))
        for spec in args.gguf:
            label, path = spec.split("=", 1)
            for n_prompt in args.llama_prompts if args.llama_bench else []:
                key = (f"llama.cpp {label}", f"pp{n_prompt}")
                best[key] = min(best.get(key, float("inf")),
                                1.0 / llama_bench(args.llama_bench, path, n_prompt, threads))
        print(f"# round {r + 1}/{args.rounds} done", flush=True)
    rows = [{"engine": k[0], "shape": k[1], "tok_per_s": round(1.0 / v, 1)} for k, v in best.items()]
    width = max(len(r["engine"]) for r in rows)
    print(f"{'engine':<{width}}  {'prompts':>8}  {'prefill tok/s':>13}")
    for row in rows:
        print(f"{row['engine']:<{width}}  {row['shape']:>8}  {row['tok_per_s']:>13.0f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"threads": threads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
