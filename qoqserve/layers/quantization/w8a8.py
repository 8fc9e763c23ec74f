"""W8A8 baseline: full-precision checkpoints quantized at load (per-channel
symmetric INT8 weights, per-token INT8 activations), on the INT8 GEMM of
int8_gemm.py: the fused C kernel where available, else torch._int_mm."""
from __future__ import annotations

import torch

from qoqserve.kernels.cpu import int8_linear as int8_kernel
from qoqserve.layers.linear import Linear, LinearMethod, UnquantizedLinearMethod
from qoqserve.layers.quantization.base import KernelChoice, QuantizationConfig
from qoqserve.layers.quantization.int8_gemm import install_packed_gemm, int8_linear


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (INT8 codes [N, K], fp32 scale [N]): symmetric, absmax / 127 per row."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-8)
    return torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8), scale


class W8A8Config(QuantizationConfig):
    """Applied at load (`--quantization w8a8`): the checkpoint is a plain FP one."""
    name = "w8a8"

    def get_linear_method(self, choice: KernelChoice | None = None) -> LinearMethod:
        choice = choice or KernelChoice()
        return W8A8LinearMethod(cpu_ops=choice.cpu_ops, fused=choice.fused_int8)


class W8A8LinearMethod(UnquantizedLinearMethod):
    def __init__(self, cpu_ops: bool = False, fused: bool = False):
        self.cpu_ops = cpu_ops
        self.fused = fused and cpu_ops
        self.name = "w8a8/torch-int8" + (int8_kernel.suffix() if self.fused else "+c" if cpu_ops else "")

    def process_weights_after_loading(self, layer: Linear) -> None:
        w_int8, scale = quantize_weight_per_channel(layer.weight.detach())
        # the float copy is no longer needed: keep only what apply() reads
        del layer._parameters["weight"]
        layer.weight = None
        if self.fused:
            install_packed_gemm(layer, w_int8, scale, None, layer.bias if layer.has_bias else None)
        else:
            layer.register_buffer("w_int8", w_int8, persistent=False)
            layer.register_buffer("w_scale", scale, persistent=False)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return layer.int8_gemm(x)
        return int8_linear(x, layer.w_int8, layer.w_scale, None,
                           layer.bias if layer.has_bias else None, self.cpu_ops)
