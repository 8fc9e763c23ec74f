"""Per-token INT8 quantization and the W4A8 GEMM epilogue on CPU (w4a8_ops.c):
one pass each, bit-identical to the torch reference in qoq_ref."""
from __future__ import annotations

import ctypes

import torch

from qoqserve.kernels.cpu import graph
from qoqserve.kernels.cpu.build import load_library

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_SIGNATURES = {
    "quantize_rows_int8": (None, [_P, _I, _L, _L, _P, _P, _P, _I]),
    "w4a8_epilogue": (None, [_P, _P, _P, _P, _P, _P, _L, _L, _P, _I, _I]),
}
_DTYPES = (torch.float32, torch.bfloat16)


def load():
    # no FMA contraction: the torch reference rounds each product and sum on its own
    return load_library("w4a8_ops", ["-ffp-contract=off"], _SIGNATURES)


def supports(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _DTYPES and load() is not None


def quantize_act_int8(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K] fp32/bf16 -> (int8 [M, K], fp32 scale [M]); as qoq_ref.quantize_act_int8."""
    x2 = x2.contiguous()
    m, k = x2.shape
    q = graph.empty(m, k, dtype=torch.int8)
    scale = graph.empty(m, dtype=torch.float32)
    graph.launch(load().quantize_rows_int8, x2.data_ptr(), int(x2.dtype == torch.bfloat16), m, k, q.data_ptr(),
                 scale.data_ptr(), None, torch.get_num_threads())
    return q, scale


def epilogue(acc: torch.Tensor, s_a: torch.Tensor, s1: torch.Tensor, out_dtype: torch.dtype,
             rowsum: torch.Tensor | None = None, zs1: torch.Tensor | None = None,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """acc int32 [M, N] -> acc * s_a * s1 (- rowsum * zs1) (+ bias) in out_dtype (fp32 or bf16)."""
    m, n = acc.shape
    acc = acc.contiguous()
    f32 = [None if t is None else t.float().contiguous() for t in (s_a, s1, rowsum, zs1, bias)]
    y = graph.empty(m, n, dtype=out_dtype)
    graph.launch(load().w4a8_epilogue, acc.data_ptr(), *[None if t is None else t.data_ptr() for t in f32], m, n,
                 y.data_ptr(), int(out_dtype == torch.bfloat16), torch.get_num_threads())
    return y
