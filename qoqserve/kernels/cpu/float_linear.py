"""The batch-invariant dense linear (float_linear.c), via ctypes: fp32 inputs
times fp32, bf16 or fp16 weights, fp32 out, each output summed in one fixed order
whatever the batch. The AVX-512 or AVX2 path is chosen at run time, capped by
QOQSERVE_CPU_ISA (kernels/cpu/isa.py); every path gives the same bits."""
from __future__ import annotations

import ctypes

import torch

from qoqserve.kernels.cpu import graph, isa
from qoqserve.kernels.cpu.build import load_library, runtime_dispatch_flags

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_SIGNATURES = {"float_linear_simd": (_I, []),
               "float_linear": (_I, [_P, _L, _L, _P, _I, _L, _P, _P, _I, _I])}
WEIGHT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the C kind codes


def load():
    # no FMA contraction beyond the explicit fmaf/fmadd: the scalar path must
    # round exactly as the vector one
    return load_library("float_linear", ["-ffp-contract=off", *runtime_dispatch_flags()], _SIGNATURES,
                        team_aware=("float_linear",))


def available() -> bool:
    return load() is not None


PATHS = ("scalar", "avx2", "avx512")  # by the kernel's simd argument 0, 1, 2


def path() -> str:
    """The loops calls take: the CPU's best, capped by QOQSERVE_CPU_ISA."""
    have = int(load().float_linear_simd())
    return next(p for p in reversed(PATHS[:have + 1]) if isa.allows(p))


def simd() -> int:
    """path() as the kernel's simd argument."""
    return PATHS.index(path())


@torch.library.custom_op("qoqserve::float_linear", mutates_args=())
def float_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float_linear as one opaque op of a captured graph."""
    return _float_linear(x, weight, bias, None)


@float_linear_op.register_fake
def _(x, weight, bias=None):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 use_simd: bool | int | None = None) -> torch.Tensor:
    """x [M, K] (any float dtype, computed in fp32) @ weight[N, K].T (+ bias,
    fp32) -> fp32 [M, N]. use_simd: a PATHS index (False: scalar), None: simd()."""
    if torch.compiler.is_compiling():
        return float_linear_op(x, weight, bias)
    return _float_linear(x, weight, bias, use_simd)


def _float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  use_simd: bool | None) -> torch.Tensor:
    if weight.dtype not in WEIGHT_DTYPES or not weight.is_contiguous() or weight.device.type != "cpu":
        raise ValueError(f"float_linear: weight must be a contiguous CPU fp32/bf16/fp16 tensor, "
                         f"got {weight.dtype} on {weight.device}")
    x = x.float().contiguous()
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"float_linear: x [{m}, {k}] does not match weight {tuple(weight.shape)}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError("float_linear: bias must be a contiguous fp32 [N] tensor")
    y = graph.empty(m, n, dtype=torch.float32)
    rc = graph.launch(load().float_linear, x.data_ptr(), m, k, weight.data_ptr(), WEIGHT_DTYPES[weight.dtype],
                      n, None if bias is None else bias.data_ptr(), y.data_ptr(),
                      int(simd() if use_simd is None else use_simd), torch.get_num_threads())
    if rc == -3:
        raise MemoryError("float_linear: could not allocate the per-thread weight panel")
    if rc != 0:
        raise RuntimeError(f"float_linear: this CPU lacks the {PATHS[int(use_simd)]} path")
    return y
