"""What Gemma 2's score soft-capping costs the C attention kernels over KV4
pages: decode (B sequences of N tokens, one query each) and prefill (the
last 512 queries of one N-token prompt) with the cap (50) and without,
taking turns, Gemma-2-2B heads (8 query, 4 KV, head_dim 256), page size 16,
fastest of 7 rounds after a warm-up, on this machine's default path
(AVX-512 VNNI scores / AMX tiles where it has them) and on the AVX-512 fp32
and AVX2 paths (QOQSERVE_CPU_ISA); the logits' cap over a 256,000-word
vocabulary beside it. Usage: python softcap_attention.py"""
import os
import time

import torch

from qoqserve.layers.attention_backends import CpuAttention
from qoqserve.layers.kv_cache import Int4KVCacheLayout
from qoqserve.layers.token_ops import CpuTokenOps

H, HKV, D, BS, CAP = 8, 4, 256, 16, 50.0


def pages(b, n):
    layout = Int4KVCacheLayout(HKV, D, BS)
    width = -(-n // BS)
    cache = layout.allocate(b * width, "cpu")
    tables = torch.randperm(b * width).view(b, width)
    for i in range(b):
        pos = torch.arange(n)
        layout.write(cache, torch.randn(n, HKV, D), torch.randn(n, HKV, D), tables[i, pos // BS] * BS + pos % BS)
    return CpuAttention(layout, quantized_prefill=True), cache, tables


def best_of_turns(fns, rounds=7):
    """The fastest time of each function, the functions taking turns."""
    for fn in fns:
        fn()
    out = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            out[i] = min(out[i], time.perf_counter() - t)
    return out


for isa in (None, "avx512", "avx2"):
    if isa:
        os.environ["QOQSERVE_CPU_ISA"] = isa
    tag = isa or "default"
    for b, n in [(1, 4096), (16, 1024), (1, 32768)]:
        attn, cache, tables = pages(b, n)
        q, lens = torch.randn(b, H, D), torch.full((b,), n)
        plain, capped = best_of_turns([lambda: attn.decode(q, cache, tables, lens, D ** -0.5),
                                       lambda: attn.decode(q, cache, tables, lens, D ** -0.5, 0, CAP)])
        print(f"[{tag}] decode B={b} N={n}: plain {plain * 1e3:.3f} ms  capped {capped * 1e3:.3f} ms  "
              f"ratio {capped / plain:.3f}", flush=True)
    attn, cache, tables = pages(1, 4096)
    q = torch.randn(512, H, D)
    plain, capped = best_of_turns([lambda: attn.prefill(q, cache, tables, [0, 512], [4096 - 512], D ** -0.5),
                                   lambda: attn.prefill(q, cache, tables, [0, 512], [4096 - 512], D ** -0.5, 0, CAP)],
                                  3)
    print(f"[{tag}] prefill last 512 of N=4096: plain {plain * 1e3:.1f} ms  capped {capped * 1e3:.1f} ms  "
          f"ratio {capped / plain:.3f}", flush=True)
os.environ.pop("QOQSERVE_CPU_ISA", None)
ops = CpuTokenOps()
for b in (1, 32):
    logits = torch.randn(b, 256000) * 20
    c_time, torch_time = best_of_turns([lambda: ops.softcap(logits, 30.0),
                                        lambda: torch.tanh(logits / 30.0) * 30.0])
    print(f"logits cap B={b} V=256000: C {c_time * 1e3:.3f} ms  torch {torch_time * 1e3:.3f} ms", flush=True)
