"""W8A8 baseline: full-precision checkpoints quantized at load (per-channel
symmetric INT8 weights, per-token INT8 activations, torch._int_mm)."""
from __future__ import annotations

import torch
from torch import nn

from qoqserve.layers.linear import Linear, UnquantizedLinearMethod


class W8A8LinearMethod(UnquantizedLinearMethod):
    def __init__(self, native_cpu_ops: bool = False):
        self.native = native_cpu_ops
        self.name = "w8a8/torch-int8" + ("+c" if native_cpu_ops else "")

    def process_weights_after_loading(self, layer: Linear) -> None:
        w = layer.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-8)
        layer.w_int8 = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
        layer.w_scale = scale
        # the float copy is no longer needed: keep only what apply() reads
        del layer._parameters["weight"]
        layer.weight = None

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        from qoqserve.layers.qoq_linear import int8_linear  # the same INT8 GEMM + epilogue
        return int8_linear(x, layer.w_int8, layer.w_scale, None,
                           layer.bias if layer.has_bias else None, self.native)

    def weight_bytes(self, layer: Linear) -> int:
        return layer.w_int8.numel() + layer.w_scale.numel() * 4
