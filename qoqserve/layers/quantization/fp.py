"""Full precision: the checkpoint's float weights; on CPU with our kernels,
fp32 activations run the batch-invariant C linear, else a torch matmul."""
from __future__ import annotations

import torch

from qoqserve.kernels.cpu import float_linear, isa
from qoqserve.layers.linear import Linear, LinearMethod, UnquantizedLinearMethod
from qoqserve.layers.quantization.base import KernelChoice, QuantizationConfig


def torch_has_fast_bf16_gemm() -> bool:
    """torch's CPU bf16 GEMM (oneDNN) has vector kernels from AVX-512 on; on
    AVX2 CPUs it is ~4x slower than float_linear.c over the same bf16 weights
    at 32+ rows (docs/runtime.md)."""
    return isa.torch_has_avx512_kernels()


# Where torch's bf16 GEMM is fast (AVX-512) and the C kernel has no bf16 dot
# products, bf16 calls of up to this many rows still run the C kernel, so that
# decode steps of up to this batch can be captured: there the captured step is
# faster than oneDNN op by op, above it slower (docs/runtime.md). Longer calls
# (larger batches, prefills) keep oneDNN.
BF16_C_MAX_ROWS = 2


def bf16_all_on_c() -> bool:
    """Whether every bf16 call runs the C kernel: where torch's bf16 GEMM is
    slow (below AVX-512), and where the C kernel has AVX512-BF16 dot products
    (faster than oneDNN at decode sizes, a little slower at prompt sizes, and
    one sum order at every row count, so bf16 is batch-invariant:
    docs/runtime.md)."""
    return not torch_has_fast_bf16_gemm() or float_linear.bf16_dot()


class CpuDenseLinearMethod(UnquantizedLinearMethod):
    """fp32 activations: kernels/cpu/float_linear.c, every output summed in one
    fixed order at any batch size (no padding trick), faster than MKL at
    decode sizes and within ~0.7-0.95x of it on prompt-sized batches
    (docs/runtime.md), and a call a captured step replays. bf16 activations
    run the same C kernel over the bf16 weights (fp32 sums, the output rounded
    to bf16 as torch's is, inside the kernel: no torch op, so such a step
    captures) where bf16_all_on_c(), else for calls of up to BF16_C_MAX_ROWS
    rows; longer calls there run MKL's bf16 GEMM. Other dtypes take the torch
    path."""
    name = "c-dense"

    def __init__(self, bf16_on_c: bool | None = None):
        self.bf16_on_c = bf16_all_on_c() if bf16_on_c is None else bf16_on_c

    def _runs_on_c(self, dtype: torch.dtype, rows: int) -> bool:
        return dtype == torch.float32 or (dtype == torch.bfloat16 and (self.bf16_on_c or rows <= BF16_C_MAX_ROWS))

    def capture_rows(self, dtype: torch.dtype) -> int | None:
        return BF16_C_MAX_ROWS if dtype == torch.bfloat16 and not self.bf16_on_c else None

    def process_weights_after_loading(self, layer: Linear) -> None:
        # the kernel's epilogue adds an fp32 bias; keep one beside the parameter
        layer.bias_fp32 = (layer.bias.detach().float().contiguous()
                           if layer.has_bias and self._runs_on_c(layer.weight.dtype, 1) else None)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if (x.dtype != layer.weight.dtype or x.dim() != 2 or not self._runs_on_c(x.dtype, x.shape[0])
                or x.device.type != "cpu"):
            return super().apply(layer, x)
        return float_linear.float_linear(x, layer.weight, layer.bias_fp32, out_dtype=x.dtype)


class UnquantizedConfig(QuantizationConfig):
    name = "fp"

    def get_linear_method(self, choice: KernelChoice | None = None) -> LinearMethod:
        if choice is not None and choice.cpu_ops and float_linear.available():
            return CpuDenseLinearMethod()
        return UnquantizedLinearMethod()
