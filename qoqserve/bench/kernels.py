"""Kernel microbenchmarks, side by side in one run (GPU).

* W4A8 GEMM (ours, Triton, per channel and g64/g128) vs cuBLAS INT8
  (torch._int_mm on the expanded INT8 weight) vs FP16 torch.matmul, on
  Llama-3-8B linear shapes at M in {1, 16, 64, 256, 1024, 4096}.
* KV4 paged decode attention (ours) vs two FP16 baselines: SDPA over a
  contiguous FP16 cache (what a dense server does; the stronger baseline)
  and the paged FP16 gather + SDPA of our torch path.

`tiny=True` shrinks every shape so the code paths can be smoke-tested on CPU
under TRITON_INTERPRET=1; those timings mean nothing.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from qoqserve.bench.timing import time_ms
from qoqserve.kernels.triton.kv4_attention import kv4_decode_attention, kv4_write
from qoqserve.kernels.triton.w4a8_gemm import w4a8_gemm
from qoqserve.layers.kv_cache import DenseKVCacheLayout, Int4KVCacheLayout

LLAMA3_8B_LINEARS = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096),
                     "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}
LLAMA3_8B_ATTN = dict(heads=32, kv_heads=8, head_dim=128)
GEMM_M = (1, 16, 64, 256, 1024, 4096)


@dataclass
class Row:
    bench: str      # "gemm" | "attention"
    shape: str
    impl: str
    ms: float
    ratio: float    # baseline time / this time (> 1: faster than the baseline)
    baseline: str


def _packed_weight(n: int, k: int, group: int, device):
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
    s1 = (torch.rand(n, device=device) * 0.01 + 0.001).half()
    if group:
        s2 = torch.full((n, k // group), 8, dtype=torch.uint8, device=device)  # 8*(u-z) fits INT8
        zeros = torch.full((n, k // group), 8, dtype=torch.uint8, device=device)
        return qweight, s1, zeros, s2
    return qweight, s1, torch.randint(0, 16, (n,), dtype=torch.uint8, device=device), None


def bench_gemm(device: torch.device, shapes: dict, m_values, iters: int) -> list[Row]:
    rows = []
    for name, (n, k) in shapes.items():
        w_int8 = torch.randint(-8, 8, (n, k), dtype=torch.int8, device=device)
        w16 = torch.randn(n, k, device=device, dtype=torch.float16)
        packed = {g: _packed_weight(n, k, g, device) for g in (0, 64, 128)}
        for m in m_values:
            shape = f"{name} M={m} N={n} K={k}"
            x = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=device)
            s_a = torch.rand(m, device=device)
            rowsum = torch.randn(m, device=device)
            x16 = torch.randn(m, k, device=device, dtype=torch.float16)
            # cuBLAS INT8 needs M > 16: pad (what a caller has to do), timed as such
            xp = F.pad(x, (0, 0, 0, max(17 - m, 0))) if device.type == "cuda" else x
            t_int8 = time_ms(lambda: torch._int_mm(xp, w_int8.t()), device, iters)
            t_fp16 = time_ms(lambda: x16 @ w16.t(), device, iters)
            rows.append(Row("gemm", shape, "cuBLAS INT8 (torch._int_mm)", t_int8, 1.0, "int8"))
            rows.append(Row("gemm", shape, "FP16 torch.matmul", t_fp16, t_int8 / t_fp16, "int8"))
            for g, (qw, s1, z, s2) in packed.items():
                t = time_ms(lambda: w4a8_gemm(x, s_a, qw, s1, z, s2, g, rowsum), device, iters)
                label = f"W4A8 {'g%d' % g if g else 'per-channel'} (ours)"
                rows.append(Row("gemm", shape, label, t, t_int8 / t, "int8"))
    return rows


def _fill_kv4(cache, num_tokens: int, kv_heads: int, head_dim: int, device):
    chunk = 65536
    for s in range(0, num_tokens, chunk):
        n = min(chunk, num_tokens - s)
        k = torch.randn(n, kv_heads, head_dim, device=device, dtype=torch.float16)
        kv4_write(cache, k, torch.randn_like(k), torch.arange(s, s + n, device=device))


def bench_attention(device: torch.device, batch: int, contexts, heads: int, kv_heads: int,
                    head_dim: int, iters: int, block_size: int = 16) -> list[Row]:
    rows = []
    scale = head_dim ** -0.5
    for ctx in contexts:
        shape = f"B={batch} ctx={ctx} H={heads} Hkv={kv_heads} D={head_dim}"
        blocks_per_seq = -(-ctx // block_size)
        num_blocks = batch * blocks_per_seq
        tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        q = torch.randn(batch, heads, head_dim, device=device, dtype=torch.float16)

        dense_k = torch.randn(batch, kv_heads, ctx, head_dim, device=device, dtype=torch.float16)
        dense_v = torch.randn_like(dense_k)
        qh = q.unsqueeze(2)
        t_sdpa = time_ms(lambda: F.scaled_dot_product_attention(qh, dense_k, dense_v, scale=scale,
                                                                enable_gqa=True), device, iters)
        del dense_k, dense_v
        rows.append(Row("attention", shape, "FP16 SDPA, contiguous cache", t_sdpa, 1.0, "fp16 sdpa"))

        fp16 = DenseKVCacheLayout(kv_heads, head_dim, block_size, torch.float16)
        pool = fp16.allocate(num_blocks, device)
        pool.normal_()

        def paged_fp16():
            k, v = fp16.read(pool, tables, torch.float16)
            return F.scaled_dot_product_attention(qh, k.transpose(1, 2), v.transpose(1, 2),
                                                  scale=scale, enable_gqa=True)
        t_paged = time_ms(paged_fp16, device, iters)
        del pool
        rows.append(Row("attention", shape, "FP16 paged gather + SDPA (our torch path)", t_paged,
                        t_sdpa / t_paged, "fp16 sdpa"))

        kv4 = Int4KVCacheLayout(kv_heads, head_dim, block_size).allocate(num_blocks, device)
        _fill_kv4(kv4, num_blocks * block_size, kv_heads, head_dim, device)
        t_kv4 = time_ms(lambda: kv4_decode_attention(q, kv4, tables, lens, scale), device, iters)
        rows.append(Row("attention", shape, "KV4 paged decode (ours, Triton)", t_kv4,
                        t_sdpa / t_kv4, "fp16 sdpa"))
        del kv4
    return rows


def run(device: str = "cuda", tiny: bool = False, iters: int = 20) -> list[Row]:
    dev = torch.device(device)
    if tiny:
        shapes = {"tiny": (96, 256)}
        return (bench_gemm(dev, shapes, (1, 16), 1)
                + bench_attention(dev, 2, (40,), heads=4, kv_heads=2, head_dim=64, iters=1))
    if dev.type != "cuda":
        raise ValueError("the kernel benchmark needs a CUDA device (--tiny smoke-tests it on CPU "
                         "under TRITON_INTERPRET=1)")
    return (bench_gemm(dev, LLAMA3_8B_LINEARS, GEMM_M, iters)
            + bench_attention(dev, 64, (1024, 4096), iters=iters, **LLAMA3_8B_ATTN))


def format_rows(rows: list[Row]) -> str:
    lines = ["| bench | shape | implementation | ms | vs baseline |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r.bench} | {r.shape} | {r.impl} | {r.ms:.4f} | {r.ratio:.2f}x {r.baseline} |")
    return "\n".join(lines)


def as_dicts(rows: list[Row]) -> list[dict]:
    return [asdict(r) for r in rows]
