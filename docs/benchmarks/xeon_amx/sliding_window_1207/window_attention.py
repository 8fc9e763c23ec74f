"""The C attention kernels over KV4 pages with and without a sliding window:
decode (B sequences of N tokens, one query each) and prefill (the last 512
queries of one N-token prompt), Mistral-7B-like heads (32 query, 8 KV,
head_dim 128), page size 16, fastest of 5 rounds after a warm-up, on this
machine's default path (AVX-512 VNNI scores / AMX tiles where it has them).
Usage: python window_attention.py"""
import time

import torch

from qoqserve.layers.attention_backends import CpuAttention
from qoqserve.layers.kv_cache import Int4KVCacheLayout

H, HKV, D, BS = 32, 8, 128, 16


def pages(b, n):
    layout = Int4KVCacheLayout(HKV, D, BS)
    width = -(-n // BS)
    cache = layout.allocate(b * width, "cpu")
    tables = torch.randperm(b * width).view(b, width)
    for i in range(b):
        pos = torch.arange(n)
        layout.write(cache, torch.randn(n, HKV, D), torch.randn(n, HKV, D), tables[i, pos // BS] * BS + pos % BS)
    return CpuAttention(layout, quantized_prefill=True), cache, tables


def best(fn, rounds=5):
    fn()
    out = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out


for b, n in [(1, 8192), (8, 8192), (1, 32768)]:
    attn, cache, tables = pages(b, n)
    q, lens = torch.randn(b, H, D), torch.full((b,), n)
    row = [f"decode B={b} N={n}:"]
    for w in (0, 4096, 1024):
        ms = best(lambda: attn.decode(q, cache, tables, lens, D ** -0.5, w)) * 1e3
        row.append(f"window {w or 'none'} {ms:.3f} ms")
    print("  ".join(row), flush=True)
for n in (8192,):
    attn, cache, tables = pages(1, n)
    q = torch.randn(512, H, D)
    row = [f"prefill last 512 of N={n}:"]
    for w in (0, 4096, 1024):
        row.append(f"window {w or 'none'} "
                   f"{best(lambda: attn.prefill(q, cache, tables, [0, 512], [n - 512], D ** -0.5, w), 3) * 1e3:.1f} ms")
    print("  ".join(row), flush=True)
