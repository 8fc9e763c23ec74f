"""The C attention kernels at head_dim 64, 128 and 256: decode (4 sequences
of 2,048 tokens, one query each, fastest of 9) and prefill (the last 512
queries of one 4,096-token prompt, fastest of 3), over bf16 and KV4 pages,
on this machine's default path and on the AVX-512 fp32 one
(QOQSERVE_CPU_ISA=avx512). Heads: 9/3 (SmolLM2) at 64, 32/8 (Llama-3-8B) at
128, 8/4 (Gemma-2-2B) at 256. Run it under two trees (PYTHONPATH) taking
turns to compare them. Usage: python attention_head_dims.py TAG"""
import os
import sys
import time

import torch

from qoqserve.layers.attention_backends import CpuAttention
from qoqserve.layers.kv_cache import DenseKVCacheLayout, Int4KVCacheLayout

BS = 16
SHAPES = [(9, 3, 64), (32, 8, 128), (8, 4, 256)]


def pages(fmt, hkv, d, b, n):
    layout = Int4KVCacheLayout(hkv, d, BS) if fmt == "int4" else DenseKVCacheLayout(hkv, d, BS, torch.bfloat16)
    width = -(-n // BS)
    cache = layout.allocate(b * width, "cpu")
    tables = torch.randperm(b * width, generator=torch.Generator().manual_seed(0)).view(b, width)
    g = torch.Generator().manual_seed(1)
    for i in range(b):
        pos = torch.arange(n)
        layout.write(cache, torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g),
                     tables[i, pos // BS] * BS + pos % BS)
    return CpuAttention(layout, quantized_prefill=True), cache, tables


def best(fn, rounds):
    fn()
    out = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out * 1e3


for fmt in ("bfloat16", "int4"):
    for isa in ("default", "avx512"):
        if isa == "default":
            os.environ.pop("QOQSERVE_CPU_ISA", None)
        else:
            os.environ["QOQSERVE_CPU_ISA"] = isa
        row = []
        for h, hkv, d in SHAPES:
            attn, cache, tables = pages(fmt, hkv, d, 4, 2048)
            q, lens = torch.randn(4, h, d, generator=torch.Generator().manual_seed(2)), torch.full((4,), 2048)
            dec = best(lambda: attn.decode(q, cache, tables, lens, d ** -0.5), 9)
            attn, cache, tables = pages(fmt, hkv, d, 1, 4096)
            q = torch.randn(512, h, d, generator=torch.Generator().manual_seed(3))
            pre = best(lambda: attn.prefill(q, cache, tables, [0, 512], [4096 - 512], d ** -0.5), 3)
            row.append(f"D{d} decode {dec:.3f} prefill {pre:.1f}")
        print(sys.argv[1], fmt, isa, " | ".join(row), flush=True)
