"""One Gemma-3-1B decode attention call (4 query heads, 1 KV head of 256,
KV4 pages, one sequence) on the C kernel, eager, fastest of 9 rounds of 50,
at context 4,096 (a global layer at depth 4,096; and a sliding one, window
512), 577 and 64. Usage: python decode_attention.py"""
import time

import torch

from qoqserve.layers.attention_backends import CpuAttention
from qoqserve.layers.kv_cache import Int4KVCacheLayout

BS = 16
layout = Int4KVCacheLayout(1, 256, BS)
backend = CpuAttention(layout, quantized_prefill=True)
for n, window in ((4096, 0), (4096, 512), (577, 0), (64, 0)):
    width = -(-n // BS)
    cache = layout.allocate(width, "cpu")
    tables = torch.randperm(width).view(1, width)
    pos = torch.arange(n)
    layout.write(cache, torch.randn(n, 1, 256), torch.randn(n, 1, 256), tables[0, pos // BS] * BS + pos % BS)
    q, lens = torch.randn(1, 4, 256), torch.tensor([n])

    def call(window=window, cache=cache, tables=tables, lens=lens):
        return backend.decode(q, cache, tables, lens, 256 ** -0.5, window)
    for _ in range(20):
        call()
    best = float("inf")
    for _ in range(9):
        t = time.perf_counter()
        for _ in range(50):
            call()
        best = min(best, (time.perf_counter() - t) / 50)
    print(f"1 seq, 4/1 heads of 256, KV4, context {n}, window {window}: {best * 1e6:.1f} us", flush=True)
