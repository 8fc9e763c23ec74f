#!/usr/bin/env python
"""One layer's prefill attention on this CPU: this tree's C kernel
(qoqserve/kernels/cpu/paged_prefill.c) against another checkout's, taking
turns in one process.

For one sequence of --ctx tokens whose last --chunk tokens are the queries
(SmolLM2's heads: 9 query, 3 KV, head_dim 64; KV4 and bf16 pages), each round
times the best of 8 calls of each build; prints both, their GFLOP/s (causal
QK and PV multiply-adds, 2 flops each) and the median ratio over the rounds,
and the largest difference between the two builds' outputs.

    git worktree add /tmp/base HEAD~1
    OMP_NUM_THREADS=2 python scripts/cpu_prefill_attention.py /tmp/base --ctx 1024 2048
"""
import argparse
import ctypes
import os
import statistics
import subprocess
import sys
from unittest import mock

import torch

from qoqserve.bench.timing import fastest_call
from qoqserve.kernels.cpu import paged_prefill
from qoqserve.layers import kv_cache as kc
from qoqserve.layers.attention_backends import CpuAttention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def other_build(checkout: str):
    """The prefill kernel as `checkout`'s own loader builds it."""
    find = "from qoqserve.kernels.cpu import paged_prefill as p; print(p.load()._name)"
    path = subprocess.run([sys.executable, "-c", find], env={**os.environ, "PYTHONPATH": checkout}, cwd=checkout,
                          capture_output=True, text=True, check=True).stdout.strip()
    lib = ctypes.CDLL(path)
    for name, (restype, argtypes) in paged_prefill._SIGNATURES.items():
        getattr(lib, name).restype, getattr(lib, name).argtypes = restype, argtypes
    return lib


def compare(lib, ctx: int, chunk: int, rounds: int) -> None:
    torch.manual_seed(0)
    pages = -(-ctx // BLOCK)
    flops = 4 * (chunk * ctx - chunk * (chunk - 1) // 2) * HEADS * HEAD_DIM
    for fmt, layout in (("KV4", kc.Int4KVCacheLayout(KV_HEADS, HEAD_DIM, BLOCK)),
                        ("bf16", kc.DenseKVCacheLayout(KV_HEADS, HEAD_DIM, BLOCK, torch.bfloat16))):
        cache = layout.allocate(pages + 1, "cpu")
        kv = [torch.randn(pages * BLOCK, KV_HEADS, HEAD_DIM) for _ in range(2)]
        layout.write(cache, *kv, torch.arange(pages * BLOCK))
        attn = CpuAttention(layout, quantized_prefill=True)
        tables, q = torch.arange(pages).view(1, pages), torch.randn(chunk, HEADS, HEAD_DIM)

        def call():
            return attn.prefill(q, cache, tables, [0, chunk], [ctx - chunk], 0.125)

        def other():
            with mock.patch.object(paged_prefill, "load", lambda: lib):
                return call()

        diff = (call() - other()).abs().max().item()
        ours, theirs = [], []
        for _ in range(rounds):
            ours.append(fastest_call(call, 8, warmup=0))
            theirs.append(fastest_call(other, 8, warmup=0))
        ratio = statistics.median(a / b for a, b in zip(ours, theirs))
        print(f"{fmt} pages, ctx {ctx}, chunk {chunk}: this tree {1e3 * min(ours):.3f} ms "
              f"({flops / min(ours) / 1e9:.0f} GFLOP/s), other {1e3 * min(theirs):.3f} ms "
              f"({flops / min(theirs) / 1e9:.0f} GFLOP/s); this/other median {ratio:.3f}; "
              f"max |difference| {diff:.2e}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("other", help="another checkout of qoqserve (a git worktree)")
    ap.add_argument("--ctx", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--chunk", type=int, default=None, help="queries per call (default: the whole context)")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    print(f"# {torch.get_num_threads()} threads; other: {args.other}")
    lib = other_build(args.other)
    for ctx in args.ctx:
        compare(lib, ctx, min(args.chunk or ctx, ctx), args.rounds)


if __name__ == "__main__":
    main()
