"""Per-token INT8 activation quantization fused with what produces the activation:
RMSNorm (before qkv and gate_up), SiLU(gate) * up (before down_proj), and a
standalone one (before o_proj). Each also returns the row sum of the
unquantized activation, which the per-channel W4A8 epilogue needs.

One program per token row; the row is held whole (BLOCK = next power of two).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qoqserve.kernels.triton.common import quantize_row_int8, rint

# the longest row one program holds whole; longer ones go in chunks (two passes)
MAX_BLOCK = 16384
CHUNK_BLOCK = 4096


@triton.jit
def _store_quantized(y, q_ptr, s_ptr, rs_ptr, row, cols, ok):
    q, scale = quantize_row_int8(y)
    tl.store(q_ptr + cols, q, mask=ok)
    tl.store(s_ptr + row, scale)
    tl.store(rs_ptr + row, tl.sum(y, axis=0))


@triton.jit
def _rmsnorm_quant_kernel(x_ptr, w_ptr, q_ptr, s_ptr, rs_ptr, K, stride_x, eps,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    # correctly rounded mean and 1/sqrt (not rsqrt.approx / div.full, what a plain
    # `/` and tl.math.rsqrt compile to), as torch computes them on CPU: an fp32
    # ulp here can flip the fp16 rounding of the row's largest element
    inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(tl.sum(x * x, axis=0), K.to(tl.float32)) + eps))
    xn = x * inv
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    # as RMSNorm: normalize in fp32, round to the activation dtype, then scale
    y = (w * xn.to(w.dtype)).to(tl.float32)
    _store_quantized(y, q_ptr + row * K, s_ptr, rs_ptr, row, cols, ok)


@triton.jit
def _silu_mul(gu_ptr, row, stride_gu, K, cols, ok):
    g_raw = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0)
    u_raw = tl.load(gu_ptr + row * stride_gu + K + cols, mask=ok, other=0.0)
    g = g_raw.to(tl.float32)
    # a correctly rounded division, as torch's silu on CPU (a plain `/` is div.full on GPU)
    silu = tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(g_raw.dtype)
    return (silu * u_raw).to(tl.float32)


@triton.jit
def _silu_mul_quant_kernel(gu_ptr, q_ptr, s_ptr, rs_ptr, K, stride_gu,
                           BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    if CHUNKS == 1:
        cols = tl.arange(0, BLOCK)
        ok = cols < K
        y = _silu_mul(gu_ptr, row, stride_gu, K, cols, ok)
        _store_quantized(y, q_ptr + row * K, s_ptr, rs_ptr, row, cols, ok)
    else:
        # rows too long to hold in registers (a whole 28672-wide row spills):
        # one pass for amax and sum, a second recomputes and quantizes
        amax_v = tl.zeros((BLOCK,), tl.float32)
        sum_v = tl.zeros((BLOCK,), tl.float32)
        for c in range(CHUNKS):
            cols = c * BLOCK + tl.arange(0, BLOCK)
            y = _silu_mul(gu_ptr, row, stride_gu, K, cols, cols < K)
            amax_v = tl.maximum(amax_v, tl.abs(y))
            sum_v += y
        amax = tl.max(amax_v, axis=0)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, 127.0), 1.0)
        for c in range(CHUNKS):
            cols = c * BLOCK + tl.arange(0, BLOCK)
            ok = cols < K
            y = _silu_mul(gu_ptr, row, stride_gu, K, cols, ok)
            q = tl.minimum(tl.maximum(rint(tl.math.div_rn(y, scale)), -127.0), 127.0)
            tl.store(q_ptr + row * K + cols, q.to(tl.int8), mask=ok)
        tl.store(s_ptr + row, scale)
        tl.store(rs_ptr + row, tl.sum(sum_v, axis=0))


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, rs_ptr, K, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < K
    y = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    _store_quantized(y, q_ptr + row * K, s_ptr, rs_ptr, row, cols, ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"expected a [M, K] activation, got shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"expected a floating-point activation, got {x.dtype}")
    return x if x.stride(-1) == 1 else x.contiguous()


def _outputs(m: int, k: int, device):
    return (torch.empty(m, k, dtype=torch.int8, device=device),
            torch.empty(m, dtype=torch.float32, device=device),
            torch.empty(m, dtype=torch.float32, device=device))


def _warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


def rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """RMSNorm(x) * weight, quantized: (int8 [M, K], scale fp32 [M], row sum fp32 [M])."""
    x = _rows(x)
    m, k = x.shape
    if weight.shape != (k,) or weight.device != x.device:
        raise ValueError(f"norm weight {tuple(weight.shape)} on {weight.device} does not match "
                         f"K={k} on {x.device}")
    weight = weight.contiguous()
    q, s, rs = _outputs(m, k, x.device)
    if m:
        block = triton.next_power_of_2(k)
        _rmsnorm_quant_kernel[(m,)](x, weight, q, s, rs, k, x.stride(0), eps, BLOCK=block,
                                    num_warps=_warps(block))
    return q, s, rs


def silu_mul_quant(gate_up: torch.Tensor, max_block: int = MAX_BLOCK):
    """silu(gate) * up of gate_up [M, 2I], quantized: (int8 [M, I], scale, row sum)."""
    gate_up = _rows(gate_up)
    m, k2 = gate_up.shape
    if k2 % 2:
        raise ValueError(f"gate_up has an odd width {k2}")
    k = k2 // 2
    q, s, rs = _outputs(m, k, gate_up.device)
    if m:
        block = triton.next_power_of_2(k)
        if block > max_block:  # two passes over chunks small enough to keep two accumulators
            block = min(CHUNK_BLOCK, max_block)
        _silu_mul_quant_kernel[(m,)](gate_up, q, s, rs, k, gate_up.stride(0), BLOCK=block,
                                     CHUNKS=triton.cdiv(k, block), num_warps=_warps(block))
    return q, s, rs


def quant_int8(x: torch.Tensor):
    """Per-token symmetric INT8 of x [M, K]: (int8, scale, row sum)."""
    x = _rows(x)
    m, k = x.shape
    q, s, rs = _outputs(m, k, x.device)
    if m:
        block = triton.next_power_of_2(k)
        _quant_kernel[(m,)](x, q, s, rs, k, x.stride(0), BLOCK=block, num_warps=_warps(block))
    return q, s, rs
