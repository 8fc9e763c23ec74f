"""Full precision: the checkpoint's float weights; on CPU with our kernels,
fp32 activations run the batch-invariant C linear, else a torch matmul."""
from __future__ import annotations

import torch

from qoqserve.kernels.cpu import float_linear
from qoqserve.layers.linear import Linear, LinearMethod, UnquantizedLinearMethod
from qoqserve.layers.quantization.base import KernelChoice, QuantizationConfig


class CpuDenseLinearMethod(UnquantizedLinearMethod):
    """fp32 activations: kernels/cpu/float_linear.c, every output summed in one
    fixed order at any batch size (no padding trick), faster than MKL at
    decode sizes and within ~0.7-0.95x of it on prompt-sized batches
    (docs/runtime.md), and a call a captured step replays. Other activation
    dtypes (bf16 uses MKL's bf16 GEMM) take the torch path."""
    name = "c-dense"

    def process_weights_after_loading(self, layer: Linear) -> None:
        # the kernel's epilogue adds an fp32 bias; keep one beside the parameter
        layer.bias_fp32 = (layer.bias.detach().float().contiguous()
                           if layer.has_bias and layer.weight.dtype == torch.float32 else None)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if (x.dtype != torch.float32 or layer.weight.dtype != torch.float32 or x.dim() != 2
                or x.device.type != "cpu"):
            return super().apply(layer, x)
        return float_linear.float_linear(x, layer.weight, layer.bias_fp32)


class UnquantizedConfig(QuantizationConfig):
    name = "fp"

    def get_linear_method(self, choice: KernelChoice | None = None) -> LinearMethod:
        if choice is not None and choice.cpu_ops and float_linear.available():
            return CpuDenseLinearMethod()
        return UnquantizedLinearMethod()
