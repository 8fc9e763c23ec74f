"""Full precision: the checkpoint's float weights, a torch matmul."""
from __future__ import annotations

from qoqserve.layers.linear import LinearMethod, UnquantizedLinearMethod
from qoqserve.layers.quantization.base import KernelChoice, QuantizationConfig


class UnquantizedConfig(QuantizationConfig):
    name = "fp"

    def get_linear_method(self, choice: KernelChoice | None = None) -> LinearMethod:
        return UnquantizedLinearMethod()
