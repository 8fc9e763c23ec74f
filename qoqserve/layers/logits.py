"""The LM head: final hidden states -> fp32 logits, with its own kernel.

At decode the LM head is the largest single read of a step (vocab x hidden
weights for a handful of rows), so it has a backend of its own, chosen with
the others (engine/backends.py):

* `LogitsHead`: torch's F.linear (batch-invariant padding on CPU);
* `CpuLogitsHead`: kernels/cpu/float_linear.c, a GEMV/GEMM summed in one
  fixed order per logit whatever the batch. It reads bf16 or fp16 weights
  when the weights are exactly such values (checkpoints stored in bf16/fp16
  are, even when the model runs in fp32), so half the bytes for the same
  numbers.
"""
from __future__ import annotations

import torch

from qoqserve.kernels.cpu import float_linear
from qoqserve.layers.linear import batch_invariant_linear


class LogitsHead:
    name = "torch"

    def prepare(self, weight: torch.Tensor) -> None:
        """Called once after the weights are loaded."""

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return batch_invariant_linear(hidden, weight).float()


class CpuLogitsHead(LogitsHead):
    name = "c"

    def __init__(self):
        self._weight: torch.Tensor | None = None
        self._source_ptr = None

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return float_linear.available() and dtype in (torch.float32, torch.bfloat16)

    def prepare(self, weight: torch.Tensor) -> None:
        w = weight.detach().contiguous()
        if w.dtype == torch.float32:
            for half in (torch.bfloat16, torch.float16):  # lossless: the same logits from half the bytes
                as_half = w.to(half)
                if torch.equal(as_half.float(), w):
                    w = as_half
                    break
        self._weight = w
        self._source_ptr = weight.data_ptr()

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._weight is None or weight.data_ptr() != self._source_ptr:
            self.prepare(weight)  # loaded again or moved: re-derive
        return float_linear.float_linear(hidden, self._weight)
