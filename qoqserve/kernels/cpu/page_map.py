"""A step's page tables and slots mapped into the sliding layers' own pool
(page_map.c), via ctypes; recorded into a captured step."""
from __future__ import annotations

import ctypes

import torch

from qoqserve.kernels.cpu import graph
from qoqserve.kernels.cpu.build import load_library

_P, _L = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {"page_map": (None, [_P, _P, _L, _P, _P, _L, _P, _L])}


def load():
    return load_library("page_map", [], _SIGNATURES, fallback="torch indexing", serial=("page_map",))


def available() -> bool:
    return load() is not None


def page_map(pages: torch.Tensor, tables: torch.Tensor, slots: torch.Tensor,
             block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pages[tables], pages[slots // block_size] * block_size + slots % block_size)
    of contiguous int64 CPU tensors."""
    bufs = (pages, tables, slots)
    if any(t.dtype != torch.int64 or not t.is_contiguous() or t.device.type != "cpu" for t in bufs):
        raise ValueError("page_map takes contiguous int64 CPU tensors")
    tables_out = graph.empty(*tables.shape, dtype=torch.int64)
    slots_out = graph.empty(*slots.shape, dtype=torch.int64)
    graph.launch(load().page_map, pages.data_ptr(), tables.data_ptr(), tables.numel(), tables_out.data_ptr(),
                 slots.data_ptr(), slots.numel(), slots_out.data_ptr(), block_size)
    return tables_out, slots_out
