"""Kernel microbenchmarks, side by side in one run (GPU), every row written
as soon as it is measured (bench/rows.py) and every case on its own: a
failing implementation leaves an error row, not a lost run.

* W4A8 GEMM (ours, Triton, per channel and g64/g128) vs cuBLAS INT8
  (torch._int_mm on the expanded INT8 weight) vs FP16 torch.matmul, on
  Llama-3-8B linear shapes, M from 1 to 4096.
* Decode attention at B in {1, 8, 64} x context {1024, 4096}: KV4 pages
  (ours, with and without context splits) vs the same kernel over fp16
  pages (what 4-bit pages save, at equal kernel quality) vs FP16 SDPA over a
  contiguous cache (the dense server's kernel, backend pinned and recorded).
* KV4 page write of 4096 tokens.

Timing: triton's do_bench median with the L2 flushed between calls
(bench/timing.kernel_ms). `tiny=True` shrinks every shape so the code paths
run on CPU under TRITON_INTERPRET=1; those timings mean nothing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from qoqserve.bench.rows import Row, RowWriter, ratio
from qoqserve.bench.timing import kernel_ms
from qoqserve.kernels.triton import interpreting
from qoqserve.kernels.triton.kv4_attention import kv4_decode_attention, kv4_write
from qoqserve.kernels.triton.paged_decode import fp16_paged_decode_attention
from qoqserve.kernels.triton.w4a8_gemm import w4a8_gemm
from qoqserve.layers.kv_cache import DenseKVCacheLayout, Int4KVCacheLayout

LLAMA3_8B_LINEARS = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096),
                     "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}
LLAMA3_8B_ATTN = dict(heads=32, kv_heads=8, head_dim=128)
GEMM_M = (1, 16, 32, 64, 128, 256, 1024, 4096)
ATTN_BATCHES = (1, 8, 64)
ATTN_CONTEXTS = (1024, 4096)


def measure(writer: RowWriter, bench: str, shape: str, impl: str, fn, device, baseline_ms=None,
            baseline: str = "", backend: str = "") -> float | None:
    """Time fn and write its row; an exception becomes an error row (ms None)."""
    try:
        ms = kernel_ms(fn, device)
        # a row without a baseline is one; a row whose baseline failed gets no ratio
        writer.add(Row(bench, shape, impl, ms, ratio(baseline_ms, ms) if baseline else 1.0,
                       baseline, backend))
        return ms
    except Exception as e:  # the row records it; the run goes on
        writer.add(Row(bench, shape, impl, None, None, baseline, backend,
                       error=f"{type(e).__name__}: {e}".splitlines()[0][:300]))
        return None


def _packed_weight(n: int, k: int, group: int, device):
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
    s1 = (torch.rand(n, device=device) * 0.01 + 0.001).half()
    if group:
        s2 = torch.full((n, k // group), 8, dtype=torch.uint8, device=device)  # 8*(u-z) fits INT8
        zeros = torch.full((n, k // group), 8, dtype=torch.uint8, device=device)
        return qweight, s1, zeros, s2
    return qweight, s1, torch.randint(0, 16, (n,), dtype=torch.uint8, device=device), None


def bench_gemm(writer: RowWriter, device: torch.device, shapes: dict, m_values) -> None:
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
            t_int8 = measure(writer, "gemm", shape, "cuBLAS INT8 (torch._int_mm)",
                             lambda: torch._int_mm(xp, w_int8.t()), device)
            measure(writer, "gemm", shape, "FP16 torch.matmul", lambda: x16 @ w16.t(), device,
                    t_int8, "int8")
            for g, (qw, s1, z, s2) in packed.items():
                label = f"W4A8 {'g%d' % g if g else 'per-channel'} (ours)"
                measure(writer, "gemm", shape, label,
                        lambda: w4a8_gemm(x, s_a, qw, s1, z, s2, g, rowsum), device, t_int8, "int8")


def sdpa_backend(q, k, v, scale):
    """The fastest SDPA backend that accepts these inputs, tried in order and
    named, so a silent fall back to the math backend cannot inflate a ratio."""
    # lazy: only the GPU benchmark pins SDPA backends
    from torch.nn.attention import SDPBackend, sdpa_kernel

    errors = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
        def run(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        try:
            run()
            return run, backend.name.lower()
        except RuntimeError as e:
            errors.append(f"{backend.name}: {str(e).splitlines()[0][:80]}")
    raise RuntimeError("no SDPA backend ran: " + "; ".join(errors))


def _fill_kv4(cache, num_tokens: int, kv_heads: int, head_dim: int, device):
    chunk = 65536
    for s in range(0, num_tokens, chunk):
        n = min(chunk, num_tokens - s)
        k = torch.randn(n, kv_heads, head_dim, device=device, dtype=torch.float16)
        kv4_write(cache, k, torch.randn_like(k), torch.arange(s, s + n, device=device))


def bench_attention(writer: RowWriter, device: torch.device, batches, contexts, heads: int,
                    kv_heads: int, head_dim: int, block_size: int = 16) -> None:
    scale = head_dim ** -0.5
    for ctx in contexts:
        for batch in batches:
            shape = f"B={batch} ctx={ctx} H={heads} Hkv={kv_heads} D={head_dim}"
            blocks_per_seq = -(-ctx // block_size)
            num_blocks = batch * blocks_per_seq
            tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            q = torch.randn(batch, heads, head_dim, device=device, dtype=torch.float16)
            t_sdpa = None
            try:
                dense_k = torch.randn(batch, kv_heads, ctx, head_dim, device=device, dtype=torch.float16)
                dense_v = torch.randn_like(dense_k)
                run, backend = sdpa_backend(q.unsqueeze(2), dense_k, dense_v, scale)
                t_sdpa = measure(writer, "attention", shape, "FP16 SDPA, contiguous cache", run, device,
                                 backend=backend)
                del dense_k, dense_v
            except Exception as e:
                writer.add(Row("attention", shape, "FP16 SDPA, contiguous cache", None, None, "",
                               error=f"{type(e).__name__}: {e}".splitlines()[0][:300]))
            base = dict(baseline_ms=t_sdpa, baseline="fp16 sdpa")
            fp16 = DenseKVCacheLayout(kv_heads, head_dim, block_size, torch.float16)
            pool = fp16.allocate(num_blocks, device).normal_()
            measure(writer, "attention", shape, "FP16 paged decode (ours, Triton, same kernel)",
                    lambda: fp16_paged_decode_attention(q, pool, tables, lens, scale), device, **base)
            kv4 = Int4KVCacheLayout(kv_heads, head_dim, block_size).allocate(num_blocks, device)
            try:
                _fill_kv4(kv4, num_blocks * block_size, kv_heads, head_dim, device)
            except Exception as e:  # the pages stay zero: still a valid (constant) KV4 pool
                writer.add(Row("attention", shape, "KV4 page fill (setup)", None, None, "",
                               error=f"{type(e).__name__}: {e}".splitlines()[0][:300]))
            measure(writer, "attention", shape, "KV4 paged decode (ours, Triton)",
                    lambda: kv4_decode_attention(q, kv4, tables, lens, scale), device, **base)
            measure(writer, "attention", shape, "KV4 paged decode, no context split",
                    lambda: kv4_decode_attention(q, kv4, tables, lens, scale, splits=1), device, **base)


def bench_kv4_write(writer: RowWriter, device: torch.device, tokens: int, kv_heads: int, head_dim: int,
                    block_size: int = 16) -> None:
    layout = Int4KVCacheLayout(kv_heads, head_dim, block_size)
    cache = layout.allocate(-(-tokens // block_size), device)
    k = torch.randn(tokens, kv_heads, head_dim, device=device, dtype=torch.float16)
    v = torch.randn_like(k)
    slots = torch.randperm(tokens, device=device)
    shape = f"T={tokens} Hkv={kv_heads} D={head_dim}"
    t_torch = measure(writer, "kv4_write", shape, "torch layout.write", lambda: layout.write(cache, k, v, slots),
                      device)
    measure(writer, "kv4_write", shape, "KV4 write (ours, Triton)", lambda: kv4_write(cache, k, v, slots),
            device, t_torch, "torch")


def check_device(device: str, tiny: bool) -> None:
    """ValueError, saying what to run instead, where the benchmark cannot run."""
    dev = torch.device(device)
    if not tiny and (dev.type != "cuda" or not torch.cuda.is_available()):
        raise ValueError("the kernel benchmark needs a CUDA device, and "
                         + ("this torch has none" if dev.type == "cuda" else f"{device} is not one")
                         + " (--tiny smoke-tests it on CPU under TRITON_INTERPRET=1; the C kernels' "
                         "benchmarks are scripts/cpu_*.py)")
    if dev.type == "cpu" and not interpreting():
        raise ValueError("on CPU the Triton kernels run only in the interpreter: set TRITON_INTERPRET=1")


def run(device: str = "cuda", tiny: bool = False, only: str | None = None,
        writer: RowWriter | None = None) -> list[Row]:
    dev = torch.device(device)
    writer = writer or RowWriter(None, echo=False)
    check_device(device, tiny)
    if tiny:
        gemm = ({"tiny": (96, 256)}, (1, 16))
        attn = dict(batches=(1, 2), contexts=(40,), heads=4, kv_heads=2, head_dim=64)
        write = dict(tokens=24, kv_heads=2, head_dim=64)
    else:
        gemm = (LLAMA3_8B_LINEARS, GEMM_M)
        attn = dict(batches=ATTN_BATCHES, contexts=ATTN_CONTEXTS, **LLAMA3_8B_ATTN)
        write = dict(tokens=4096, kv_heads=8, head_dim=128)
    if only in (None, "gemm"):
        bench_gemm(writer, dev, *gemm)
    if only in (None, "attention"):
        bench_attention(writer, dev, **attn)
        bench_kv4_write(writer, dev, **write)
    return writer.rows
