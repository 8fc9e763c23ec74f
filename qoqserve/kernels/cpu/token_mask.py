"""Token bitmasks applied to logits on CPU (token_mask.c), via ctypes."""
from __future__ import annotations

import ctypes

import torch

from qoqserve.kernels.cpu.build import load_library

_P, _L = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {"apply_token_bitmask": (None, [_P, _L, _P, _L, _P, _L, _L]),
               "rows_left_empty": (_L, [_P, _L, _P, _L, _L, _P])}


def load():
    return load_library("token_mask", [], _SIGNATURES)


def available() -> bool:
    return load() is not None


def _check_logits(logits: torch.Tensor, rows: torch.Tensor, what: str) -> None:
    if (logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1
            or rows.dtype != torch.int64 or not rows.is_contiguous()):
        raise ValueError(f"{what}: fp32 [B, V] logits with unit column stride, int64 rows")


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[j], t] = -inf where bit t of bitmask[j] is 0.
    logits fp32 [B, V] with unit column stride; bitmask int32 [len(rows), >= ceil(V/32)]
    contiguous; rows int64."""
    _check_logits(logits, rows, "apply_token_bitmask")
    if bitmask.dtype != torch.int32 or not bitmask.is_contiguous():
        raise ValueError("apply_token_bitmask: a contiguous int32 bitmask")
    vocab, words = logits.shape[1], bitmask.shape[1]
    if words * 32 < vocab or bitmask.shape[0] != rows.shape[0]:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not cover {rows.shape[0]} rows of {vocab} tokens")
    load().apply_token_bitmask(logits.data_ptr(), logits.stride(0), rows.data_ptr(), rows.shape[0],
                               bitmask.data_ptr(), words, vocab)


def rows_left_empty(logits: torch.Tensor, rows: torch.Tensor) -> list[int]:
    """Those of rows (int64) whose every logit is -inf, in their order."""
    _check_logits(logits, rows, "rows_left_empty")
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= logits.shape[0]):
        raise ValueError(f"rows outside the {logits.shape[0]} rows of the logits")
    empty = torch.empty(rows.shape[0], dtype=torch.int64)
    n = load().rows_left_empty(logits.data_ptr(), logits.stride(0), rows.data_ptr(), rows.shape[0],
                               logits.shape[1], empty.data_ptr())
    return empty[:n].tolist()
