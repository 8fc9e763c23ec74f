"""Paged prefill attention on CPU (paged_prefill.c), via ctypes: the queries of
prompt chunks, causal over their sequences' pages, in fp32, for every page
format paged_decode reads. Its AVX-512 or AVX2 path is chosen at run time;
QOQSERVE_CPU_ISA=avx2 / scalar caps it."""
from __future__ import annotations

import ctypes

import torch

from qoqserve.kernels.cpu import graph
from qoqserve.kernels.cpu.build import load_library
from qoqserve.kernels.cpu.paged_decode import _FLAGS, FORMATS, PATHS, check_pages

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_SIGNATURES = {"paged_prefill_attention": (
    _I, [_P, _P, _P, _L, _L, _I, _P, _P, _P, _P] + [_I] * 6 + [ctypes.c_float, _I, ctypes.c_float, _I]),
    "paged_prefill_isa": (_I, []), "paged_prefill_amx": (_I, [_I, _I])}


def load():
    return load_library("paged_prefill", _FLAGS, _SIGNATURES)


def available() -> bool:
    return load() is not None


def isa() -> str:
    """The path the kernel takes now: "avx512", "avx2" or "scalar" (reads QOQSERVE_CPU_ISA)."""
    return PATHS[load().paged_prefill_isa()]


def amx_from(fmt: str, head_dim: int) -> int | None:
    """The first query position whose prefill attention takes the AMX tiles
    (KV4 pages, head_dim a multiple of 64, a CPU with AMX-INT8, QOQSERVE_CPU_ISA
    not below "amx"), or None where no position does."""
    pos = load().paged_prefill_amx(FORMATS[fmt], head_dim)
    return pos if pos >= 0 else None


@torch.library.custom_op("qoqserve::paged_prefill", mutates_args=())
def paged_prefill_op(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, fmt: str,
                     block_size: int, block_tables: torch.Tensor, query_starts: torch.Tensor,
                     first_positions: torch.Tensor, sm_scale: float, window: int, softcap: float) -> torch.Tensor:
    """paged_prefill_attention as one opaque op of a compiled graph."""
    return _paged_prefill(q, k_rows, v_rows, fmt, block_size, block_tables, query_starts,
                          first_positions, sm_scale, window, softcap)


@paged_prefill_op.register_fake
def _(q, k_rows, v_rows, fmt, block_size, block_tables, query_starts, first_positions, sm_scale, window, softcap):
    return torch.empty_like(q)


def paged_prefill_attention(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, fmt: str,
                            block_size: int, block_tables: torch.Tensor,
                            query_starts: torch.Tensor | list[int],
                            first_positions: torch.Tensor | list[int], sm_scale: float,
                            window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """q [T, H, D], the queries of S sequences back to back -> [T, H, D] in q's dtype.

    Sequence s owns rows query_starts[s] .. query_starts[s + 1] - 1 (S + 1
    offsets), the first at position first_positions[s] (its cached prefix);
    each query attends to every position up to its own (window > 0: the last
    `window` of them), read from the pages (block_tables [S, width]): the
    chunk's own K/V must be written first. k_rows, v_rows, softcap as for
    paged_decode_attention.
    """
    if torch.compiler.is_compiling():
        return paged_prefill_op(q, k_rows, v_rows, fmt, block_size, block_tables,
                                torch.as_tensor(query_starts), torch.as_tensor(first_positions), sm_scale, window,
                                softcap)
    return _paged_prefill(q, k_rows, v_rows, fmt, block_size, block_tables, query_starts,
                          first_positions, sm_scale, window, softcap)


def _paged_prefill(q, k_rows, v_rows, fmt, block_size, block_tables, query_starts, first_positions,
                   sm_scale, window, softcap) -> torch.Tensor:
    t, h, d = q.shape
    hkv = check_pages(q, k_rows, v_rows, fmt)
    starts = torch.as_tensor(query_starts, dtype=torch.int64).contiguous()
    first = torch.as_tensor(first_positions, dtype=torch.int64).contiguous()
    s = first.shape[0]
    if starts.shape != (s + 1,) or block_tables.shape[0] != s or int(starts[-1]) != t:
        raise ValueError(f"{s} sequences need {s + 1} query offsets ending at {t} and {s} block-table "
                         f"rows; got {tuple(starts.shape)}, {tuple(block_tables.shape)}")
    qf = q.float().contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    size = k_rows.element_size()
    out = graph.empty(*qf.shape, dtype=qf.dtype)
    rc = graph.launch(
        load().paged_prefill_attention, qf.data_ptr(), k_rows.data_ptr(), v_rows.data_ptr(),
        k_rows.stride(0) * size, k_rows.stride(1) * size, FORMATS[fmt], tables.data_ptr(), starts.data_ptr(),
        first.data_ptr(), out.data_ptr(), s, h, hkv, d, block_size, tables.shape[1], float(sm_scale),
        int(window), float(softcap), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("paged prefill kernel could not allocate its scratch buffers")
    return out.to(q.dtype)
