"""The fused INT8 linear of the CPU path (int8_linear.c), via ctypes: weights
packed once at load for AVX-512 VNNI (and, as they are, AMX-INT8 for calls of
many rows) or for AVX2 (the same layout), then quantize + GEMM + epilogue in
one call. Where the CPU or compiler has neither, `available()` is False and
the caller keeps the torch._int_mm path."""
from __future__ import annotations

import ctypes

import torch

from qoqserve.kernels.cpu import graph
from qoqserve.kernels.cpu.build import cpu_vendor_flags, load_library
from qoqserve.kernels.cpu.weight_layout import interleave_tiles

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_SIGNATURES = {
    "int8_linear_available": (_I, []),
    "int8_linear_amx": (_I, []),
    "int8_linear": (_I, [_P, _I, _L, _L, _P, _L, _I, _P, _P, _P, _P, _P, _I, _I]),
}
BLOCK_N, QUAD_K = 16, 4
DTYPES = (torch.float32, torch.bfloat16)  # of the input and output


def load():
    # no FMA contraction: the reference rounds each product and sum on its own
    lib = load_library("int8_linear", ["-ffp-contract=off", *cpu_vendor_flags()], _SIGNATURES,
                       team_aware=("int8_linear",))
    if lib is None or not lib.int8_linear_available():
        return None
    lib.int8_linear.streams = _weight_spans
    return lib


def _weight_spans(a: list[int]) -> list[tuple[int, int]]:
    """The bytes an int8_linear call (its argument values a) streams: its
    weights as pack_weight lays them out, N and K rounded up to whole blocks."""
    K, w, N = a[3], a[4], a[5]
    return [(w, -(-N // BLOCK_N) * BLOCK_N * (-(-K // QUAD_K) * QUAD_K))]


def available() -> bool:
    return load() is not None


def isa() -> str:
    """The path the fused kernel runs here: "avx512-vnni" (AMX for calls of
    12+ rows where uses_amx()) or "avx2"."""
    return {2: "avx512-vnni", 1: "avx2"}[int(load().int8_linear_available())]


def suffix() -> str:
    """The path as the linear methods' names show it."""
    return "+vnni" if isa() == "avx512-vnni" else "+avx2"


def uses_amx() -> bool:
    """Whether calls of 12+ rows take the AMX-INT8 tiles here (the CPU has
    them and QOQSERVE_CPU_ISA does not cap the kernels below AMX)."""
    lib = load()
    return lib is not None and bool(lib.int8_linear_amx())


def pack_weight(w: torch.Tensor, offset: int) -> torch.Tensor:
    """w [N, K] integer codes (int8, or uint8 0..15) -> the kernel's uint8
    [ceil(N/16), ceil(K/4), 16, 4] bytes of w + offset (must fit 0..255),
    tiles interleaved (weight_layout.py)."""
    n, k = w.shape
    u = w.to(torch.int16) + offset
    if int(u.min()) < 0 or int(u.max()) > 255:
        raise ValueError(f"weight codes + offset {offset} leave 0..255")
    np_, kp = -(-n // BLOCK_N) * BLOCK_N, -(-k // QUAD_K) * QUAD_K
    u = torch.nn.functional.pad(u, (0, kp - k, 0, np_ - n)).to(torch.uint8)
    return interleave_tiles(u.view(np_ // BLOCK_N, BLOCK_N, kp // QUAD_K, QUAD_K).permute(0, 2, 1, 3))


def int8_linear(x2: torch.Tensor, packed: torch.Tensor, n: int, offset: int, s1: torch.Tensor,
                rowsum: torch.Tensor | None = None, zs1: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x2 [M, K] fp32/bf16 -> [M, n] in x2's dtype: per-token INT8 x2 times the
    packed weight, then acc * s_a * s1 (- rowsum * zs1) (+ bias). s1, zs1, bias:
    fp32 [n]; rowsum: fp32 [M] of the unquantized rows."""
    x2 = x2.contiguous()
    m, k = x2.shape
    if packed.shape[1] * QUAD_K < k or packed.shape[0] * BLOCK_N < n:
        raise ValueError(f"packed weight {tuple(packed.shape)} does not cover [{n}, {k}]")
    y = graph.empty(m, n, dtype=x2.dtype)
    ptr = [None if t is None else t.data_ptr() for t in (s1, rowsum, zs1, bias)]
    rc = graph.launch(load().int8_linear, x2.data_ptr(), int(x2.dtype == torch.bfloat16), m, k,
                      packed.data_ptr(), n, offset, *ptr, y.data_ptr(), int(x2.dtype == torch.bfloat16),
                      torch.get_num_threads())
    if rc != 0:
        raise MemoryError("INT8 linear kernel could not allocate its scratch buffers")
    return y
