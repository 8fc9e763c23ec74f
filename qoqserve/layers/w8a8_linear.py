"""W8A8 baseline: full-precision checkpoints quantized at load (per-channel
symmetric INT8 weights, per-token INT8 activations): the INT8 GEMM of
layers/int8_gemm.py, fused C kernel where available, else torch._int_mm."""
from __future__ import annotations

import torch

from qoqserve.layers.int8_gemm import (
    fused_int8_available,
    install_packed_gemm,
    int8_linear,
)
from qoqserve.layers.linear import Linear, UnquantizedLinearMethod


class W8A8LinearMethod(UnquantizedLinearMethod):
    def __init__(self, native_cpu_ops: bool = False):
        self.native = native_cpu_ops
        self.name = "w8a8/torch-int8" + ("+c" if native_cpu_ops else "")

    def process_weights_after_loading(self, layer: Linear) -> None:
        w = layer.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-8)
        w_int8 = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
        # the float copy is no longer needed: keep only what apply() reads
        del layer._parameters["weight"]
        layer.weight = None
        if self.native and fused_int8_available():
            install_packed_gemm(layer, w_int8, scale, None, layer.bias if layer.has_bias else None)
        else:
            layer.w_int8, layer.w_scale = w_int8, scale

    def describe(self, layer: Linear) -> str:
        return "w8a8/torch-int8+vnni" if getattr(layer, "int8_gemm", None) is not None else self.name

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if getattr(layer, "int8_gemm", None) is not None:
            return layer.int8_gemm(x)
        return int8_linear(x, layer.w_int8, layer.w_scale, None,
                           layer.bias if layer.has_bias else None, self.native)
