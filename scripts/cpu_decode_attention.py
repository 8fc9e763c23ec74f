#!/usr/bin/env python
"""One layer's decode attention on this CPU, per page format, same C kernel.

For B sequences of L tokens (SmolLM2's heads: 9 query, 3 KV, head_dim 64),
pages allocated contiguously as a fresh engine does, times the C paged-decode
kernel (qoqserve/kernels/cpu/paged_decode.c) over KV4, KV8, bf16, fp16 and
fp32 pages and prints ms per call and the bytes of K/V it reads.

    python scripts/cpu_decode_attention.py > docs/benchmarks/decode_attention_cpu.txt
"""
import argparse
import platform

import torch

from qoqserve.bench.timing import best_of_rounds
from qoqserve.layers import kv_cache as kc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    heads, hkv, d, bs = 9, 3, 64, 16
    b, n = args.batch, args.tokens
    layouts = {"int4": kc.CpuInt4KVCacheLayout(hkv, d, bs), "int8": kc.CpuInt8KVCacheLayout(hkv, d, bs)}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        layouts[str(dtype).replace("torch.", "")] = kc.CpuDenseKVCacheLayout(hkv, d, bs, dtype)
    width = -(-n // bs)
    tables = torch.arange(b * width).view(b, width)
    lens = torch.full((b,), n)
    torch.manual_seed(0)
    q = torch.randn(b, heads, d)
    print(f"# {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"{b} sequences x {n} tokens, {heads} query / {hkv} KV heads, head_dim {d}; best of 3")
    print(f"{'pages':>9} {'ms':>7} {'K+V MB':>7} {'GB/s':>6}")
    for name, layout in layouts.items():
        cache = layout.allocate(b * width, "cpu")
        pos = torch.arange(n)
        for i in range(b):
            layout.write(cache, torch.randn(n, hkv, d), torch.randn(n, hkv, d), tables[i, pos // bs] * bs + pos % bs)
        t = best_of_rounds(lambda: layout.decode_attention(q, cache, tables, lens, d ** -0.5), 5)
        mb = layout.bytes_per_token() * b * n / 1e6
        print(f"{name:>9} {1e3 * t:>7.2f} {mb:>7.1f} {mb / 1e3 / t:>6.1f}")


if __name__ == "__main__":
    main()
