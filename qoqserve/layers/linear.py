"""Linear layers and the linear-method extension point.

A quantization method plugs in here and nowhere else: the model builds
`Linear` modules and never looks at how their weights are stored or multiplied.
A method has three hooks, as in vLLM:

* ``create_weights`` registers the parameters the method's checkpoint format
  holds, with a ``weight_loader`` on each that knows how to copy one shard of a
  fused layer (q/k/v into qkv, gate/up into gate_up) into place;
* ``process_weights_after_loading`` turns what was loaded into what ``apply``
  wants (repacking, caching an expanded copy, ...), once;
* ``apply`` computes ``x @ W.T (+ b)``.

Two optional hooks let a method fuse the op that produces its input (the
RMSNorm before qkv/gate_up, the SiLU*mul before down_proj) with its own input
preparation, e.g. INT8 quantization; ``apply`` then receives what they return.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod(ABC):
    name = "abstract"

    @abstractmethod
    def create_weights(self, layer: "Linear", dtype: torch.dtype) -> None:
        ...

    def process_weights_after_loading(self, layer: "Linear") -> None:
        pass

    @abstractmethod
    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        ...

    def describe(self, layer: "Linear") -> str:
        """Kernel path used by this layer, for the load-time log and stats."""
        return self.name

    def input_from_norm(self, norm: nn.Module, h: torch.Tensor, delta: torch.Tensor | None = None):
        """(this layer's input when it is norm(h + delta), h + delta): the
        residual stream after the add (h itself when delta is None)."""
        if delta is None:
            return norm(h), h
        return norm(h, delta)

    def input_from_silu_mul(self, gate_up: torch.Tensor, silu_mul):
        """This layer's input when it is silu(gate) * up of a fused gate_up
        output; silu_mul: the model's own op for it."""
        return silu_mul(gate_up)


def _shard_loader(param: torch.Tensor, loaded: torch.Tensor, shard: int | None,
                  offsets: list[int]) -> None:
    """Copy a checkpoint tensor into its rows of a (possibly fused) parameter."""
    if shard is None:
        dst = param
    else:
        dst = param.narrow(0, offsets[shard], offsets[shard + 1] - offsets[shard])
    if tuple(dst.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch: parameter slice {tuple(dst.shape)}, "
                         f"checkpoint tensor {tuple(loaded.shape)}")
    dst.copy_(loaded)


class UnquantizedLinearMethod(LinearMethod):
    """Plain high-precision weights, torch matmul."""
    name = "torch-dense"

    def create_weights(self, layer: "Linear", dtype: torch.dtype) -> None:
        # torch.empty, not nn.Linear: no random init, the checkpoint overwrites it
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=dtype),
                                    requires_grad=False)
        layer.weight.weight_loader = layer.load_shard
        if layer.has_bias:
            layer.bias = nn.Parameter(torch.empty(layer.out_features, dtype=dtype),
                                      requires_grad=False)
            layer.bias.weight_loader = layer.load_shard

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return batch_invariant_linear(x, layer.weight, layer.bias if layer.has_bias else None)


_MIN_ROWS = 12


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear whose row results do not depend on how many rows there are.

    MKL's fp32 GEMM changes its summation order for a few small M (1-3, 5-7,
    9-11 seen here); padding to 12 rows keeps each request's result the same
    whatever else shares its batch.
    """
    m = x.shape[0]
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and m < _MIN_ROWS:
        return F.linear(F.pad(x, (0, 0, 0, _MIN_ROWS - m)), weight, bias)[:m]
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """y = x W^T (+ b), possibly several checkpoint matrices fused along the output.

    ``output_sizes`` lists the fused parts (e.g. [q, k, v]); checkpoint tensors
    are loaded one part at a time by index.
    """

    def __init__(self, in_features: int, output_sizes: list[int] | int, bias: bool,
                 method: LinearMethod, dtype: torch.dtype):
        super().__init__()
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.in_features = in_features
        self.out_features = sum(self.output_sizes)
        self.has_bias = bias
        self.method = method
        self.offsets = [0]
        for size in self.output_sizes:
            self.offsets.append(self.offsets[-1] + size)
        method.create_weights(self, dtype)

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None) -> None:
        _shard_loader(param, loaded, shard, self.offsets)

    def forward(self, x) -> torch.Tensor:
        return self.method.apply(self, x)

    def input_from_norm(self, norm: nn.Module, h: torch.Tensor, delta: torch.Tensor | None = None):
        return self.method.input_from_norm(norm, h, delta)

    def input_from_silu_mul(self, gate_up: torch.Tensor, silu_mul):
        return self.method.input_from_silu_mul(gate_up, silu_mul)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.output_sizes}, bias={self.has_bias}, "
                f"method={self.method.describe(self)}")
