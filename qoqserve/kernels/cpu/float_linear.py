"""The batch-invariant dense linear (float_linear.c), via ctypes: fp32 (or
bf16) inputs times fp32, bf16 or fp16 weights, each output summed in one fixed
order whatever the batch. The AVX-512 or AVX2 path is chosen at run time,
capped by QOQSERVE_CPU_ISA (kernels/cpu/isa.py); every path gives the same
bits, except that bf16 rows times bf16 weights on the avx512-bf16 path take
vdpbf16ps's pair order (float_linear_dot.h), and on the amx-bf16 path the
tiles' order (float_linear_amx.h), on every row count alike."""
from __future__ import annotations

import ctypes

import torch

from qoqserve.kernels.cpu import graph, isa
from qoqserve.kernels.cpu.build import load_library, runtime_dispatch_flags

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_SIGNATURES = {"float_linear_simd": (_I, []),
               "float_linear": (_I, [_P, _L, _L, _P, _I, _L, _P, _P, _I, _I]),
               "float_linear_bf16": (_I, [_P, _L, _L, _P, _I, _L, _P, _P, _I, _I, _I])}
WEIGHT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the C kind codes


def load():
    # no FMA contraction beyond the explicit fmaf/fmadd: the scalar path must
    # round exactly as the vector one
    return load_library("float_linear", ["-ffp-contract=off", *runtime_dispatch_flags()], _SIGNATURES,
                        team_aware=("float_linear", "float_linear_bf16"))


def available() -> bool:
    return load() is not None


PATHS = ("scalar", "avx2", "avx512", "avx512-bf16", "amx-bf16")  # by the kernel's simd argument 0..4
# the QOQSERVE_CPU_ISA level a path needs: the bf16 dot products come with VNNI
_LEVEL = {"avx512-bf16": "avx512-vnni", "amx-bf16": "amx"}


def path() -> str:
    """The loops calls take: the CPU's best, capped by QOQSERVE_CPU_ISA."""
    have = int(load().float_linear_simd())
    return next(p for p in reversed(PATHS[:have + 1]) if isa.allows(_LEVEL.get(p, p)))


def bf16_dot() -> bool:
    """Whether bf16 rows times bf16 weights take a bf16 path of their own
    here (the dot products or the AMX tiles), one sum order at every row
    count."""
    return available() and path() in ("avx512-bf16", "amx-bf16")


def simd() -> int:
    """path() as the kernel's simd argument."""
    return PATHS.index(path())


@torch.library.custom_op("qoqserve::float_linear", mutates_args=())
def float_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    out_bf16: bool = False) -> torch.Tensor:
    """float_linear as one opaque op of a captured graph."""
    return _float_linear(x, weight, bias, None, torch.bfloat16 if out_bf16 else torch.float32)


@float_linear_op.register_fake
def _(x, weight, bias=None, out_bf16=False):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16 if out_bf16 else torch.float32)


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 use_simd: bool | int | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] (any float dtype, computed in fp32) @ weight[N, K].T (+ bias,
    fp32) -> [M, N] in out_dtype: fp32, or bf16 for bf16 x (each output
    rounded as torch's .to(bfloat16) of the fp32 one). bf16 rows are widened
    inside the kernel, so a bf16 model's call runs no torch op (a captured
    step records it). use_simd: a PATHS index (False: scalar), None: simd()."""
    if torch.compiler.is_compiling():
        return float_linear_op(x, weight, bias, out_dtype == torch.bfloat16)
    return _float_linear(x, weight, bias, use_simd, out_dtype)


def _float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  use_simd: bool | None, out_dtype: torch.dtype) -> torch.Tensor:
    if weight.dtype not in WEIGHT_DTYPES or not weight.is_contiguous() or weight.device.type != "cpu":
        raise ValueError(f"float_linear: weight must be a contiguous CPU fp32/bf16/fp16 tensor, "
                         f"got {weight.dtype} on {weight.device}")
    bf16_rows = x.dtype == torch.bfloat16
    if out_dtype not in (torch.float32, torch.bfloat16) or (out_dtype == torch.bfloat16 and not bf16_rows):
        raise ValueError(f"float_linear: {x.dtype} rows give fp32 outputs (bf16 rows: fp32 or bf16), not {out_dtype}")
    x = x.contiguous() if bf16_rows else x.float().contiguous()
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"float_linear: x [{m}, {k}] does not match weight {tuple(weight.shape)}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError("float_linear: bias must be a contiguous fp32 [N] tensor")
    y = graph.empty(m, n, dtype=out_dtype)
    path = int(simd() if use_simd is None else use_simd)
    args = (x.data_ptr(), m, k, weight.data_ptr(), WEIGHT_DTYPES[weight.dtype], n,
            None if bias is None else bias.data_ptr(), y.data_ptr())
    if bf16_rows:
        rc = graph.launch(load().float_linear_bf16, *args, int(out_dtype == torch.bfloat16), path,
                          torch.get_num_threads())
    else:
        rc = graph.launch(load().float_linear, *args, path, torch.get_num_threads())
    if rc == -3:
        raise MemoryError("float_linear: could not allocate its per-thread buffers")
    if rc != 0:
        raise RuntimeError(f"float_linear: this CPU lacks the {PATHS[path]} path")
    return y
