"""Token bitmasks applied to logits on CPU (token_mask.c), via ctypes."""
from __future__ import annotations

import ctypes

import torch

from qoqserve.kernels.cpu.build import load_library

_P, _L = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {"apply_token_bitmask": (None, [_P, _L, _P, _L, _P, _L, _L])}


def load():
    return load_library("token_mask", [], _SIGNATURES)


def available() -> bool:
    return load() is not None


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[j], t] = -inf where bit t of bitmask[j] is 0.
    logits fp32 [B, V] with unit column stride; bitmask int32 [len(rows), >= ceil(V/32)]
    contiguous; rows int64."""
    if (logits.dtype != torch.float32 or logits.stride(1) != 1 or bitmask.dtype != torch.int32
            or not bitmask.is_contiguous() or rows.dtype != torch.int64 or not rows.is_contiguous()):
        raise ValueError("apply_token_bitmask: fp32 logits rows, a contiguous int32 bitmask, int64 rows")
    vocab, words = logits.shape[1], bitmask.shape[1]
    if words * 32 < vocab or bitmask.shape[0] != rows.shape[0]:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not cover {rows.shape[0]} rows of {vocab} tokens")
    load().apply_token_bitmask(logits.data_ptr(), logits.stride(0), rows.data_ptr(), rows.shape[0],
                               bitmask.data_ptr(), words, vocab)
