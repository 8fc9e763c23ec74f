"""The step of a decode burst that feeds each row's chosen token back as its
next input (decode_advance.c), via ctypes; recorded into a captured plan."""
from __future__ import annotations

import ctypes

import torch

from qoqserve.kernels.cpu import graph
from qoqserve.kernels.cpu.build import load_library

_P, _L = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {"decode_advance": (ctypes.c_int, [_P, _P, _P, _P, _P, _P, _L, _L, _L, _L, _P, _P, _L])}


def load():
    return load_library("decode_advance", [], _SIGNATURES, fallback="single decode steps",
                        serial=("decode_advance",))


def available() -> bool:
    return load() is not None


def advance(chosen: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, context_lens: torch.Tensor,
            slots: torch.Tensor, block_tables: torch.Tensor, block_size: int, pad_slot: int,
            history: torch.Tensor, step: torch.Tensor) -> None:
    """Rows 0..len(chosen)-1 of a decode step's int64 inputs move on by one
    token: ids = chosen (also stored as history[step]), positions and
    context_lens + 1, slots from block_tables [rows >= len(chosen), width]
    (pad_slot past a row's table); step [1] += 1 (history [steps, len(chosen)])."""
    rows = chosen.shape[0]
    bufs = (chosen, ids, positions, context_lens, slots, block_tables, history, step)
    if any(t.dtype != torch.int64 or not t.is_contiguous() for t in bufs) or history.shape[1:] != (rows,) \
            or min(ids.shape[0], positions.shape[0], context_lens.shape[0], slots.shape[0],
                   block_tables.shape[0]) < rows or step.numel() != 1:
        raise ValueError("advance takes contiguous int64 buffers of at least len(chosen) rows, "
                         "history [steps, len(chosen)] and a one-element step")
    if graph.launch(load().decode_advance, chosen.data_ptr(), ids.data_ptr(), positions.data_ptr(),
                    context_lens.data_ptr(), slots.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
                    block_size, pad_slot, rows, history.data_ptr(), step.data_ptr(), history.shape[0]):
        raise RuntimeError("decode_advance: the burst's history is full")
