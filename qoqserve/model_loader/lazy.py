"""Checkpoint tensors read only where a rank needs them.

A tensor-parallel rank keeps a slice of most tensors; a `LazyTensor` lets the
model's weight loaders cut it (narrow) before any byte is read, so reading a
safetensors checkpoint costs each rank about its shard, not the whole model
(layers/linear.py `Linear.load_shard` narrows, then materializes).
"""
from __future__ import annotations

from typing import Callable

import torch


class LazyTensor:
    def __init__(self, source, shape: tuple[int, ...], check: Callable[[torch.Tensor], None],
                 index: tuple[slice, ...] | None = None,
                 transform: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """source: a safetensors slice (indexable by a tuple of slices); check:
        the format's value checks, run on what is read; transform: applied to
        what is read, elementwise (so it commutes with narrow), e.g. a fold."""
        self._source, self._check, self._transform = source, check, transform
        self.shape = torch.Size(shape)
        self._index = index or tuple(slice(0, n) for n in shape)

    def narrow(self, dim: int, start: int, length: int) -> "LazyTensor":
        if start < 0 or start + length > self.shape[dim]:
            raise ValueError(f"slice [{start}:{start + length}] of dim {dim} outside {tuple(self.shape)}")
        index = list(self._index)
        base = index[dim].start
        index[dim] = slice(base + start, base + start + length)
        shape = list(self.shape)
        shape[dim] = length
        return LazyTensor(self._source, tuple(shape), self._check, tuple(index), self._transform)

    def materialize(self) -> torch.Tensor:
        t = self._source[self._index]
        self._check(t)
        return t if self._transform is None else self._transform(t)
