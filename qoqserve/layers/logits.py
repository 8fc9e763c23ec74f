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
* `Int8LogitsHead` (`--lm-head-dtype int8`): per-channel INT8 weights and
  per-token INT8 hidden states on the INT8 GEMM of the W8A8 linears: half
  the bytes of bf16, at a perplexity cost (docs/accuracy.md).
"""
from __future__ import annotations

import torch

from qoqserve.kernels.cpu import float_linear
from qoqserve.kernels.cpu import int8_linear as int8_kernel
from qoqserve.layers.linear import batch_invariant_linear
from qoqserve.layers.quantization.int8_gemm import PackedInt8Gemm, int8_linear
from qoqserve.layers.quantization.w8a8 import quantize_weight_per_channel


class LogitsHead:
    name = "torch"
    # whether the head computes from a copy of its own in another format, so
    # that the model's weight is never read once prepared (models/llama.py
    # release_lm_head)
    own_copy_only = False

    def prepare(self, weight: torch.Tensor) -> None:
        """Called once after the weights are loaded."""

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return batch_invariant_linear(hidden, weight).float()

    def resident_bytes(self) -> int:
        """Bytes this head holds besides the model's own weight."""
        return 0

    def read_bytes(self, weight: torch.Tensor) -> int:
        """Weight bytes one call reads: its own copy, or the model's weight."""
        return self.resident_bytes() or weight.numel() * weight.element_size()


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

    def resident_bytes(self) -> int:
        w = self._weight
        return 0 if w is None or w.data_ptr() == self._source_ptr else w.numel() * w.element_size()


class Int8LogitsHead(LogitsHead):
    """fused: the packed VNNI kernel (CPU); else torch._int_mm between C or
    torch quantize / epilogue passes."""
    own_copy_only = True

    def __init__(self, fused: bool, cpu_ops: bool):
        self.fused, self.cpu_ops = fused, cpu_ops
        self.name = "int8" + (int8_kernel.suffix() if fused else "")
        self._source_ptr = None

    def prepare(self, weight: torch.Tensor) -> None:
        w_int8, self._scale = quantize_weight_per_channel(weight.detach())
        self._gemm = PackedInt8Gemm(w_int8, self._scale, None, None) if self.fused else None
        self._w_int8 = None if self.fused else w_int8
        self._source_ptr = weight.data_ptr()

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not weight.is_meta and weight.data_ptr() != self._source_ptr:  # meta: released after prepare
            self.prepare(weight)
        if self._gemm is not None:
            return self._gemm(hidden).float()
        return int8_linear(hidden, self._w_int8, self._scale, None, None, self.cpu_ops).float()

    def resident_bytes(self) -> int:
        held = [self._scale] + ([self._w_int8] if self._gemm is None else list(self._gemm.buffers()))
        return sum(t.numel() * t.element_size() for t in held)
