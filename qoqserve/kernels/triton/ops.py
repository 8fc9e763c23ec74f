"""The Triton kernels of the CUDA path as torch custom ops (torch.library),
with fake implementations, so that a compiled graph (torch.compile) keeps
each as one opaque node instead of breaking at it or tracing into Triton's
launcher; the C kernels of the CPU path are registered the same way
(kernels/cpu/*.py).

Callers use the functions below: while torch.compile traces they go through
the registered op, otherwise they call the launcher directly (the
dispatcher's few microseconds a call would be pure overhead in an eager or
CUDA-graph step). Either way the same launcher runs with the same arguments.
"""
from __future__ import annotations

import torch

from qoqserve.kernels.triton.act_quant import quant_int8 as _quant_int8
from qoqserve.kernels.triton.act_quant import rmsnorm_quant as _rmsnorm_quant
from qoqserve.kernels.triton.act_quant import silu_mul_quant as _silu_mul_quant
from qoqserve.kernels.triton.kv4_attention import kv4_write as _kv4_write
from qoqserve.kernels.triton.paged_decode import kv4_decode_attention as _kv4_decode
from qoqserve.kernels.triton.w4a8_gemm import w4a8_gemm as _w4a8_gemm

Quantized = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _quantized_like(m: int, k: int, like: torch.Tensor) -> Quantized:
    """(int8 [M, K], scale fp32 [M], row sum fp32 [M]): what the activation quantizers return."""
    return (like.new_empty(m, k, dtype=torch.int8), like.new_empty(m, dtype=torch.float32),
            like.new_empty(m, dtype=torch.float32))


@torch.library.custom_op("qoqserve::triton_quant_int8", mutates_args=())
def quant_int8_op(x: torch.Tensor) -> Quantized:
    return _quant_int8(x)


@quant_int8_op.register_fake
def _(x):
    return _quantized_like(x.shape[0], x.shape[1], x)


@torch.library.custom_op("qoqserve::triton_rmsnorm_quant", mutates_args=())
def rmsnorm_quant_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Quantized:
    return _rmsnorm_quant(x, weight, eps)


@rmsnorm_quant_op.register_fake
def _(x, weight, eps):
    return _quantized_like(x.shape[0], x.shape[1], x)


@torch.library.custom_op("qoqserve::triton_silu_mul_quant", mutates_args=())
def silu_mul_quant_op(gate_up: torch.Tensor) -> Quantized:
    return _silu_mul_quant(gate_up)


@silu_mul_quant_op.register_fake
def _(gate_up):
    return _quantized_like(gate_up.shape[0], gate_up.shape[1] // 2, gate_up)


@torch.library.custom_op("qoqserve::triton_w4a8_gemm", mutates_args=())
def w4a8_gemm_op(x_q: torch.Tensor, s_a: torch.Tensor, qweight: torch.Tensor, s1: torch.Tensor,
                 zeros: torch.Tensor, s2: torch.Tensor | None, group_size: int, rowsum: torch.Tensor | None,
                 bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    return _w4a8_gemm(x_q, s_a, qweight, s1, zeros, s2, group_size, rowsum, bias, out_dtype=out_dtype)


@w4a8_gemm_op.register_fake
def _(x_q, s_a, qweight, s1, zeros, s2, group_size, rowsum, bias, out_dtype):
    return x_q.new_empty(x_q.shape[0], qweight.shape[0], dtype=out_dtype)


@torch.library.custom_op("qoqserve::triton_kv4_write", mutates_args=("cache",))
def kv4_write_op(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _kv4_write(cache, k, v, slot_mapping)


@kv4_write_op.register_fake
def _(cache, k, v, slot_mapping):
    return None


@torch.library.custom_op("qoqserve::triton_kv4_decode", mutates_args=())
def kv4_decode_op(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                  sm_scale: float, window: int, softcap: float) -> torch.Tensor:
    return _kv4_decode(q, cache, block_tables, context_lens, sm_scale, window, softcap)


@kv4_decode_op.register_fake
def _(q, cache, block_tables, context_lens, sm_scale, window, softcap):
    return torch.empty_like(q)


def quant_int8(x: torch.Tensor) -> Quantized:
    """Per-token INT8 of x [M, K] (act_quant.quant_int8)."""
    return quant_int8_op(x) if torch.compiler.is_compiling() else _quant_int8(x)


def rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Quantized:
    """RMSNorm(x) * weight, quantized (act_quant.rmsnorm_quant)."""
    return rmsnorm_quant_op(x, weight, eps) if torch.compiler.is_compiling() else _rmsnorm_quant(x, weight, eps)


def silu_mul_quant(gate_up: torch.Tensor) -> Quantized:
    """silu(gate) * up, quantized (act_quant.silu_mul_quant)."""
    return silu_mul_quant_op(gate_up) if torch.compiler.is_compiling() else _silu_mul_quant(gate_up)


def w4a8_gemm(x_q: torch.Tensor, s_a: torch.Tensor, qweight: torch.Tensor, s1: torch.Tensor,
              zeros: torch.Tensor, s2: torch.Tensor | None, group_size: int, rowsum: torch.Tensor | None,
              bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The packed W4A8 GEMM with its epilogue (w4a8_gemm.w4a8_gemm)."""
    if torch.compiler.is_compiling():
        return w4a8_gemm_op(x_q, s_a, qweight, s1, zeros, s2, group_size, rowsum, bias, out_dtype)
    return _w4a8_gemm(x_q, s_a, qweight, s1, zeros, s2, group_size, rowsum, bias, out_dtype=out_dtype)


def kv4_write(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """K/V quantized into their KV4 page slots, in place (kv4_attention.kv4_write)."""
    (kv4_write_op if torch.compiler.is_compiling() else _kv4_write)(cache, k, v, slot_mapping)


def kv4_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, sm_scale: float, window: int = 0,
                         softcap: float = 0.0) -> torch.Tensor:
    """One query per sequence over its KV4 pages (paged_decode.kv4_decode_attention)."""
    if torch.compiler.is_compiling():
        return kv4_decode_op(q, cache, block_tables, context_lens, sm_scale, window, softcap)
    return _kv4_decode(q, cache, block_tables, context_lens, sm_scale, window, softcap)
