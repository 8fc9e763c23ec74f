"""The runtime side of a quantization scheme, in vLLM's shape: one config
object per scheme, made from the checkpoint's quant_config.json (or from an
engine flag, for schemes applied at load), that says what the checkpoint
holds and hands out the linear method and the KV-page format that run it.

The loader validates a checkpoint through it (the tensor schema comes from
the model built on the meta device with the config's linear method), the
quantizer's writer writes through it, and the engine asks it for methods;
nobody indexes the JSON by hand.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from qoqserve.layers.linear import LinearMethod


@dataclass(frozen=True)
class KernelChoice:
    """What the engine resolved its kernels to (engine/backends.py): the family
    ("torch", "cpu" = our C kernels, "triton"), the QoQ W4A8 execution
    ("torch-int8", "torch-int8-percall", "sim", "triton") and whether the fused
    C INT8 linear is available on this CPU."""
    kernels: str = "torch"
    w4a8: str = "torch-int8"
    fused_int8: bool = False

    @property
    def cpu_ops(self) -> bool:
        return self.kernels == "cpu"


class QuantizationConfig(ABC):
    name = "abstract"
    # the KV-page format the checkpoint was calibrated for ("int4", "int8"), or
    # None: the activations' dtype
    kv_format: str | None = None
    key_transform = False        # attention carries a KeyTransform (layers/key_transform.py)
    # checkpoint tensors of fused linears are stored fused (qkv_proj.*) rather
    # than per part (q_proj.*, k_proj.*, ...) as HF full-precision files do
    stores_fused_linears = False
    # --lm-head-dtype auto gives this scheme an INT8 LM head on the CPU kernels
    int8_lm_head = False

    @abstractmethod
    def get_linear_method(self, choice: KernelChoice | None = None) -> LinearMethod:
        """The method the model's linears run; choice None: any (schema only)."""

    def linear_methods(self, choice: KernelChoice | None = None) -> Callable[[str], LinearMethod]:
        """A linear's method by its name ("layers.{i}.mlp.down_proj"): the one
        method of get_linear_method unless the checkpoint mixes schemes."""
        method = self.get_linear_method(choice)
        return lambda name: method

    def get_kv_format(self) -> str | None:
        return self.kv_format

    def check_tensor(self, name: str, tensor: torch.Tensor, where: str) -> None:
        """Value ranges the kernels rely on, as each tensor streams in."""

    def float_storage_dtype(self, name: str) -> torch.dtype | None:
        """The dtype a writer stores float tensor `name` in (None: as it is)."""
        return None

    def to_config(self) -> dict | None:
        """What quant_config.json holds for this scheme (None: no file)."""
        return None
