"""W8A8 baseline: full-precision checkpoints quantized at load (per-channel
symmetric INT8 weights, per-token INT8 activations, torch._int_mm)."""
from __future__ import annotations

import torch
from torch import nn

from qoqserve.kernels import qoq_ref
from qoqserve.layers.linear import Linear, UnquantizedLinearMethod


class W8A8LinearMethod(UnquantizedLinearMethod):
    name = "w8a8/torch-int8"

    def process_weights_after_loading(self, layer: Linear) -> None:
        w = layer.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-8)
        layer.w_int8 = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
        layer.w_scale = scale
        # the float copy is no longer needed: keep only what apply() reads
        del layer._parameters["weight"]
        layer.weight = None

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        y = qoq_ref.w4a8_group_linear(x, layer.w_int8, layer.w_scale)  # same INT8 GEMM + epilogue
        if layer.has_bias:
            y = y + layer.bias.float()
        return y.to(x.dtype)

    def weight_bytes(self, layer: Linear) -> int:
        return layer.w_int8.numel() + layer.w_scale.numel() * 4
