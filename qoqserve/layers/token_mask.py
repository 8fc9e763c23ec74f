"""Constrained decoding as the sampler sees it: a request may carry a
TokenConstraint (engine/structured.py makes them from grammars) that writes
the tokens it allows next into one row of a bitmask; the sampler gathers the
rows of the constrained requests and applies them to the logits in one call,
so a batch without constraints pays nothing and a mixed one only for its
constrained rows.

Bit t of a row is bit t % 32 of its int32 word t // 32 (xgrammar's layout).
"""
from __future__ import annotations

from typing import Protocol

import torch

from qoqserve.kernels.cpu import token_mask as cpu_token_mask


class TokenConstraint(Protocol):
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row]; must not change the
        constraint's state (a failed step is re-run and fills again)."""


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor,
                                  rows: list[int]) -> None:
    """In place, with torch ops: any device, any float dtype (the C kernel's reference)."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(len(rows), -1)[:, :vocab].to(logits.device).bool()
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))


def _on_cpu_kernel(logits: torch.Tensor) -> bool:
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(1) == 1
            and cpu_token_mask.available())


def rows_left_empty_reference(logits: torch.Tensor, rows: list[int]) -> list[int]:
    dead = torch.isneginf(logits[rows]).all(dim=1).tolist()
    return [i for i, d in zip(rows, dead) if d]


def rows_left_empty(logits: torch.Tensor, rows: list[int]) -> list[int]:
    """Those of rows whose every logit is -inf: nothing is left to pick there."""
    if not rows:
        return []
    if _on_cpu_kernel(logits):
        return cpu_token_mask.rows_left_empty(logits, torch.tensor(rows, dtype=torch.long))
    return rows_left_empty_reference(logits, rows)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits[rows[j], t] = -inf where bit t of bitmask[j] is 0, in place."""
    if _on_cpu_kernel(logits):
        cpu_token_mask.apply_token_bitmask(logits, bitmask, torch.tensor(rows, dtype=torch.long))
    else:
        apply_token_bitmask_reference(logits, bitmask, rows)


class ConstraintMasks:
    """The sampler's bitmask buffer (grown to the largest count of constrained rows seen)."""

    def __init__(self):
        self._buf: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor, constraints: list[TokenConstraint | None]) -> list[int]:
        """Masks the constrained rows in place; returns the rows left with no
        token at all (their grammar has reached a dead end)."""
        rows = [i for i, c in enumerate(constraints) if c is not None]
        if not rows:
            return []
        words = bitmask_words(logits.shape[1])
        if self._buf is None or self._buf.shape[0] < len(rows) or self._buf.shape[1] != words:
            self._buf = torch.empty(max(len(rows), 8), words, dtype=torch.int32)
        mask = self._buf[:len(rows)]
        for j, i in enumerate(rows):
            constraints[i].fill_bitmask(mask, j)
        apply_token_bitmask(logits, mask, rows)
        return rows_left_empty(logits, rows)
