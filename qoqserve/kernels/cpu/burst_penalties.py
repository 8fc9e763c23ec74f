"""Penalties (and min_tokens' stop-token bans) inside a decode burst on CPU
(burst_penalties.c), via ctypes."""
from __future__ import annotations

import ctypes

import torch

from qoqserve.kernels.cpu import graph
from qoqserve.kernels.cpu.build import load_library

_P, _L = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {"penalize_step": (ctypes.c_int, [_P, _L, _L, _L, _P, _P, _P, _P, _P, _P, _P, _L, _P, _P, _P, _L,
                                                _P, _P, _P, _L, _P, _P, _P, _L, _P, _P, ctypes.c_int])}


def load():
    # -ffp-contract=off: the arithmetic of penalize_rows, bit for bit (penalty_ops.h)
    return load_library("burst_penalties", ["-ffp-contract=off"], _SIGNATURES, fallback="single steps",
                        team_aware=("penalize_step",))


def available() -> bool:
    return load() is not None


def penalize_step(logits: torch.Tensor, greedy: torch.Tensor, state: dict, history: torch.Tensor,
                  step: torch.Tensor) -> None:
    """One burst step's penalties on logits [rows, V] (fp32, rows = len(greedy)),
    in place, and the penalized greedy rows' tokens into greedy; `state`: the
    rows' buffers (engine/burst_penalties.py), history [steps, rows]."""
    rows = greedy.shape[0]
    s = state
    if (logits.dtype != torch.float32 or logits.stride(1) != 1 or logits.shape[0] < rows
            or history.shape[1:] != (rows,) or s["seen"].shape[1] * 32 < logits.shape[1]):
        raise ValueError("penalize_step: fp32 logits rows, history [steps, rows], a seen bitmap of the vocabulary")
    status = graph.launch(
        load().penalize_step, logits.data_ptr(), logits.stride(0), logits.shape[1], rows, greedy.data_ptr(),
        s["temperature"].data_ptr(), s["on"].data_ptr(), s["rep"].data_ptr(), s["presence"].data_ptr(),
        s["frequency"].data_ptr(), s["seen"].data_ptr(), s["seen"].shape[1], s["out_tok"].data_ptr(),
        s["out_cnt"].data_ptr(), s["out_len"].data_ptr(), s["out_tok"].shape[1], s["bias_tok"].data_ptr(),
        s["bias_val"].data_ptr(), s["bias_len"].data_ptr(), s["bias_tok"].shape[1], s["stop_tok"].data_ptr(),
        s["stop_len"].data_ptr(), s["ban_steps"].data_ptr(), s["stop_tok"].shape[1], history.data_ptr(),
        step.data_ptr(), torch.get_num_threads())
    if status:
        raise RuntimeError(f"penalize_step failed ({status}): a row's output counts are full")
