"""Paged decode attention on CPU (paged_decode.c), via ctypes: one kernel for
KV4, KV8 and dense fp16/bf16/fp32 pages. Its AVX-512 or AVX2 path is chosen
at run time; QOQSERVE_CPU_ISA=avx2 / scalar caps it."""
from __future__ import annotations

import ctypes
import platform

import torch

from qoqserve.kernels.cpu import graph
from qoqserve.kernels.cpu.build import load_library
from qoqserve.kernels.kv_ref import kv_row_bytes

# -fassociative-math lets the portable path's loops vectorize; no finite-math
# flags, the softmax starts from -inf. On x86 the library is built for a
# baseline CPU (a later -march overrides build.py's -march=native): the
# AVX-512 code carries its own target and is only entered after a CPUID check,
# so one build runs on any x86-64 machine.
_FLAGS = ["-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
if platform.machine() in ("x86_64", "AMD64"):
    _FLAGS.append("-march=x86-64-v2")
_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_SIGNATURES = {"paged_decode_attention": (
    _I, [_P, _P, _P, _L, _L, _I, _P, _P, _P] + [_I] * 6 + [ctypes.c_float, _I, ctypes.c_float, _I]),
    "paged_decode_isa": (_I, [])}
_SIGNATURES["paged_decode_fetch"] = _SIGNATURES["paged_decode_attention"]
_SIGNATURES["paged_decode_attention_bf16"] = _SIGNATURES["paged_decode_attention"]  # bf16 q and out
# page formats, as the C enum numbers them (row sizes: kv_ref.kv_row_bytes)
FORMATS = {"int4": 0, "int8": 1, "float16": 2, "bfloat16": 3, "float32": 4}


def load():
    lib = load_library("paged_decode", _FLAGS, _SIGNATURES,
                       team_aware=("paged_decode_attention", "paged_decode_attention_bf16"))
    if lib is not None:  # what a waiting thread of a replayed step fetches before a call (replay.py)
        lib.paged_decode_attention.fetcher = lib.paged_decode_fetch
        lib.paged_decode_attention_bf16.fetcher = lib.paged_decode_fetch
    return lib


def available() -> bool:
    return load() is not None


PATHS = {0: "scalar", 256: "avx2", 512: "avx512", 513: "avx512"}  # by the kernels' isa() codes


def isa() -> str:
    """The path the kernel takes now: "avx512", "avx2" or "scalar" (reads QOQSERVE_CPU_ISA)."""
    return PATHS[load().paged_decode_isa()]


def kv4_scores() -> str:
    """How KV4 scores are computed now: "vnni" (integer dot products), "fp32"
    (codes converted to fp32 by a vector path: CPUs without VNNI, or
    QOQSERVE_CPU_ISA=avx512 / avx2) or "scalar"."""
    return {513: "vnni", 512: "fp32", 256: "fp32"}.get(load().paged_decode_isa(), "scalar")


def supports_dtype(dtype: torch.dtype) -> bool:
    """Whether dense pages of this dtype have a format here."""
    return str(dtype).replace("torch.", "") in FORMATS


@torch.library.custom_op("qoqserve::paged_decode", mutates_args=())
def paged_decode_op(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, fmt: str,
                    block_size: int, block_tables: torch.Tensor, context_lens: torch.Tensor,
                    sm_scale: float, window: int, softcap: float) -> torch.Tensor:
    """paged_decode_attention as one opaque op of a captured graph."""
    return _paged_decode(q, k_rows, v_rows, fmt, block_size, block_tables, context_lens, sm_scale, window,
                         softcap)


@paged_decode_op.register_fake
def _(q, k_rows, v_rows, fmt, block_size, block_tables, context_lens, sm_scale, window, softcap):
    return torch.empty_like(q)


def check_pages(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, fmt: str) -> int:
    """The number of KV heads, after checking that queries q [..., H, D] and
    page rows [num_slots, Hkv, row] fit the kernels (shared with paged_prefill)."""
    h, d = q.shape[-2:]
    _, hkv, row = k_rows.shape
    if fmt not in FORMATS or k_rows.stride() != v_rows.stride() or k_rows.stride(2) != 1:
        raise ValueError(f"unsupported pages: {fmt}, strides {k_rows.stride()} / {v_rows.stride()}")
    if row * k_rows.element_size() != kv_row_bytes(fmt, d) or h % hkv or h // hkv > 64:
        raise ValueError(f"unsupported shapes: q {tuple(q.shape)}, {fmt} rows {tuple(k_rows.shape)}")
    return hkv


def paged_decode_attention(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, fmt: str,
                           block_size: int, block_tables: torch.Tensor, context_lens: torch.Tensor,
                           sm_scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q [B, H, D] over paged K/V -> [B, H, D] in q's dtype (fp32 math).

    k_rows, v_rows: views [num_slots, Hkv, row] of one layer's page pool (one
    row = one token's K or V of one head, in format `fmt`), with equal strides.
    A sequence with context length 0 (a padding row) gets zeros. window > 0:
    sliding-window attention, each query over its sequence's last `window`
    positions only. softcap > 0: each score s becomes softcap * tanh(s /
    softcap) before the softmax (Gemma 2's logit soft-capping).
    """
    args = (q, k_rows, v_rows, fmt, block_size, block_tables, context_lens, sm_scale, window, softcap)
    return paged_decode_op(*args) if torch.compiler.is_compiling() else _paged_decode(*args)


def _paged_decode(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, fmt: str,
                  block_size: int, block_tables: torch.Tensor, context_lens: torch.Tensor,
                  sm_scale: float, window: int, softcap: float) -> torch.Tensor:
    b, h, d = q.shape
    hkv = check_pages(q, k_rows, v_rows, fmt)
    size = k_rows.element_size()
    # bf16 queries (a bf16 model) are widened and the outputs rounded inside
    # the kernel: no torch op runs around it, so a captured step records it
    bf16 = q.dtype == torch.bfloat16
    qf = q.contiguous() if bf16 else q.float().contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    out = graph.empty(*qf.shape, dtype=qf.dtype)
    lib = load()
    rc = graph.launch(
        lib.paged_decode_attention_bf16 if bf16 else lib.paged_decode_attention, qf.data_ptr(), k_rows.data_ptr(),
        v_rows.data_ptr(), k_rows.stride(0) * size, k_rows.stride(1) * size, FORMATS[fmt], tables.data_ptr(),
        lens.data_ptr(), out.data_ptr(), b, h, hkv, d, block_size, tables.shape[1], float(sm_scale),
        int(window), float(softcap), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("paged decode kernel could not allocate its scratch buffers")
    return out.to(q.dtype)
