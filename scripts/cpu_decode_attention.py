#!/usr/bin/env python
"""One layer's decode attention on this CPU, per page format, same C kernel,
against this machine's measured read bandwidth.

For B sequences of L tokens (SmolLM2's heads: 9 query, 3 KV, head_dim 64),
pages allocated contiguously as a fresh engine does (--scattered: shuffled),
times the C paged-decode kernel (qoqserve/kernels/cpu/paged_decode.c) over
KV4, KV8, bf16, fp16 and fp32 pages and prints ms per call, the bytes of K+V
it must read, GB/s and that as a fraction of a stream read (torch.sum over
512 MB) measured in the same run. --baseline OLD.c also times another build of
the kernel (e.g. an earlier commit's, same C signature) side by side:

    git show 261e195:qoqserve/kernels/cpu/paged_decode.c > /tmp/old_paged_decode.c
    OMP_NUM_THREADS=2 python scripts/cpu_decode_attention.py --baseline /tmp/old_paged_decode.c \\
        > docs/benchmarks/decode_attention_cpu.txt
"""
import argparse
import ctypes
import os
import platform
import subprocess
import tempfile
from unittest import mock

import torch

from qoqserve.bench.timing import best_of_rounds
from qoqserve.kernels.cpu import paged_decode
from qoqserve.layers import kv_cache as kc

SHAPES = [(32, 1024), (32, 4096), (1, 4096)]
_OLD_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno",
              "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]


def stream_gbs(mb: int = 512) -> float:
    """Read bandwidth: a sum over a tensor far larger than the caches."""
    x = torch.ones(mb * 2**20 // 4)
    t = best_of_rounds(lambda: x.sum(), 3)
    return x.numel() * 4 / t / 1e9


def build_baseline(source: str):
    out = os.path.join(tempfile.mkdtemp(), "old_paged_decode.so")
    subprocess.run(["cc", *_OLD_FLAGS, "-o", out, source, "-lm"], check=True)
    lib = ctypes.CDLL(out)
    restype, argtypes = paged_decode._SIGNATURES["paged_decode_attention"]
    lib.paged_decode_attention.restype, lib.paged_decode_attention.argtypes = restype, argtypes
    return lib


def layouts(hkv, d, bs):
    out = {"int4": kc.CpuInt4KVCacheLayout(hkv, d, bs), "int8": kc.CpuInt8KVCacheLayout(hkv, d, bs)}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        out[str(dtype).replace("torch.", "")] = kc.CpuDenseKVCacheLayout(hkv, d, bs, dtype)
    return out


def run_shape(b, n, old_lib, stream, scattered, heads=9, hkv=3, d=64, bs=16):
    width = -(-n // bs)
    order = torch.randperm(b * width) if scattered else torch.arange(b * width)
    tables = order.view(b, width)
    lens = torch.full((b,), n)
    q = torch.randn(b, heads, d)
    print(f"\n## {b} sequences x {n} tokens ({'scattered' if scattered else 'contiguous'} pages of {bs})")
    print(f"{'pages':>9} {'K+V MB':>7} {'old ms':>7} {'new ms':>7} {'speedup':>7} {'GB/s':>6} {'of stream':>9}")
    for name, layout in layouts(hkv, d, bs).items():
        cache = layout.allocate(b * width, "cpu")
        pos = torch.arange(n)
        for i in range(b):
            layout.write(cache, torch.randn(n, hkv, d), torch.randn(n, hkv, d), tables[i, pos // bs] * bs + pos % bs)
        call = lambda: layout.decode_attention(q, cache, tables, lens, d ** -0.5)  # noqa: E731
        reps = max(3, int(2e6 // (b * n)))
        new = best_of_rounds(call, reps)
        old = float("nan")
        if old_lib is not None:
            with mock.patch.object(paged_decode, "load", lambda: old_lib):
                old = best_of_rounds(call, reps)
        mb = layout.bytes_per_token() * b * n / 1e6
        gbs = mb / 1e3 / new
        print(f"{name:>9} {mb:>7.1f} {1e3 * old:>7.2f} {1e3 * new:>7.3f} {old / new:>6.1f}x "
              f"{gbs:>6.1f} {gbs / stream:>8.0%}")
        del cache


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", help="another paged_decode.c (same C signature) to time side by side")
    ap.add_argument("--scattered", action="store_true", help="shuffle the page order")
    args = ap.parse_args()
    torch.manual_seed(0)
    old_lib = build_baseline(args.baseline) if args.baseline else None
    before = stream_gbs()
    print(f"# {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"kernel path {paged_decode.isa()}; 9 query / 3 KV heads, head_dim 64; best of 3 rounds")
    print(f"# stream read (torch.sum over 512 MB): {before:.1f} GB/s; 'of stream' = GB/s / that")
    print("# K+V MB: bytes the kernel must read (codes + scales/zeros); old = --baseline build")
    for b, n in SHAPES:
        run_shape(b, n, old_lib, before, args.scattered)
    print(f"\n# stream read again at the end: {stream_gbs():.1f} GB/s")


if __name__ == "__main__":
    main()
