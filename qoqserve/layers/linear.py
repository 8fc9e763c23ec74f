"""Linear layers and the linear-method extension point.

A quantization method plugs in here and nowhere else: the model builds
`Linear` modules and never looks at how their weights are stored or multiplied.
A method has three hooks, as in vLLM:

* ``create_weights`` registers the parameters the method's checkpoint format
  holds (``add_param``: with the layer's one weight loader, which copies one
  part of a fused layer, q/k/v into qkv or gate/up into gate_up, and under
  tensor parallelism takes this rank's slice of it), and says of each which
  dim indexes the layer's inputs and how many inputs one element covers (a
  4-bit byte: 2, a group scale: the group), so a row-parallel layer can cut
  every format's tensors at its input slice;
* ``process_weights_after_loading`` turns what was loaded into what ``apply``
  wants (repacking, caching an expanded copy, ...), once;
* ``apply`` computes ``x @ W.T (+ b)``.

Two optional hooks let a method fuse the op that produces its input (the
RMSNorm before qkv/gate_up, the SiLU*mul before down_proj) with its own input
preparation, e.g. INT8 quantization; ``apply`` then receives what they return.
A third lets a gate_up layer whose output only SiLU*mul reads (the model says
so: ``silu_mul_after``) make that product in its own epilogue.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

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

    def input_alignment(self) -> int:
        """The inputs one stored element or group covers: a row-parallel
        slice of the inputs must start and end on a multiple of it."""
        return 1

    def describe(self, layer: "Linear") -> str:
        """Kernel path used by this layer, for the load-time log and stats."""
        return self.name

    def capture_rows(self, dtype: torch.dtype) -> int | None:
        """The most rows a call on `dtype` activations may have and still be
        a kernel a captured step replays (None: any): the engine captures
        decode steps only up to that batch."""
        return None

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

    def silu_mul_output(self, layer: "Linear", x, silu_mul) -> torch.Tensor | None:
        """silu(gate) * up of this (silu_mul_after) layer's output, rounded as
        the model's silu_mul rounds it, made by the method itself; None where
        it cannot (the model then applies silu_mul to the output)."""
        return None


def add_param(layer: "Linear", name: str, shape: tuple[int, ...], dtype: torch.dtype,
              input_dim: int | None = None, input_pack: int = 1) -> nn.Parameter:
    """Register one checkpoint tensor of `layer` (dim 0 always indexes its output
    channels). input_dim: the dim indexing its inputs (None: it has none, e.g. a
    per-channel scale); input_pack: inputs per element along it."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = layer.load_shard
    param.input_dim, param.input_pack = input_dim, input_pack
    layer.register_parameter(name, param)
    return param


@dataclass(frozen=True)
class LinearShard:
    """This rank's part of a linear under tensor parallelism (layers/parallel.py)."""
    # column parallel: (first row, rows) of each fused output part, in that part's rows
    rows: tuple[tuple[int, int], ...] | None = None
    # row parallel: (first input, inputs), and the all-reduce of the partial sums
    cols: tuple[int, int] | None = None
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    add_bias: bool = True  # row parallel: one rank adds the bias to the sum


def materialize(t) -> torch.Tensor:
    """A checkpoint tensor's values: t itself, or a lazily read one's (model_loader/lazy.py)."""
    return t if isinstance(t, torch.Tensor) else t.materialize()


def _copy(dst: torch.Tensor, loaded) -> None:
    if tuple(dst.shape) != tuple(loaded.shape):
        raise ValueError(f"shape mismatch: parameter slice {tuple(dst.shape)}, "
                         f"checkpoint tensor {tuple(loaded.shape)}")
    dst.copy_(materialize(loaded))


class UnquantizedLinearMethod(LinearMethod):
    """Plain high-precision weights, torch matmul."""
    name = "torch-dense"

    def create_weights(self, layer: "Linear", dtype: torch.dtype) -> None:
        # torch.empty, not nn.Linear: no random init, the checkpoint overwrites it
        add_param(layer, "weight", (layer.out_features, layer.in_features), dtype, input_dim=1)
        if layer.has_bias:
            add_param(layer, "bias", (layer.out_features,), dtype)

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

    ``output_sizes`` lists the fused parts (e.g. [q, k, v]) and ``in_features``
    the inputs, whole; with a ``shard`` the layer holds and computes only this
    rank's slice of them, and checkpoint tensors (whole, or one part at a
    time by index) are cut to it as they load.
    """

    def __init__(self, in_features: int, output_sizes: list[int] | int, bias: bool,
                 method: LinearMethod, dtype: torch.dtype, shard: LinearShard | None = None,
                 silu_mul_after: bool = False):
        """silu_mul_after: the output (gate | up halves) is only ever read as
        silu(gate) * up (silu_mul_output), so the method may store its
        channels in whatever order serves that."""
        super().__init__()
        self.silu_mul_after = silu_mul_after
        full = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.shard = shard = shard or LinearShard()
        self.full_offsets = _offsets(full)
        self.output_sizes = [n for _, n in shard.rows] if shard.rows else full
        self.full_in_features = in_features
        self.in_features = shard.cols[1] if shard.cols else in_features
        self.out_features = sum(self.output_sizes)
        self.has_bias = bias
        self.method = method
        self.offsets = _offsets(self.output_sizes)
        if shard.cols:
            align, (first, n) = method.input_alignment(), shard.cols
            if first % align or n % align:
                raise ValueError(
                    f"tensor parallel: this rank's inputs {first}..{first + n} of {in_features} do not "
                    f"start and end on a multiple of {align} (the weights' quantization group): "
                    "choose a tensor-parallel size whose input slices hold whole groups")
        method.create_weights(self, dtype)

    def load_shard(self, param: torch.Tensor, loaded, part: int | None) -> None:
        """Copy a checkpoint tensor (the whole layer, or fused part `part`) into
        `param`, taking this rank's rows and inputs of it."""
        cols, rows = self.shard.cols, self.shard.rows
        dim = getattr(param, "input_dim", None)
        whole = list(param.shape)  # what the checkpoint holds: every row and input
        whole[0] = self.full_offsets[-1] if part is None else self.full_offsets[part + 1] - self.full_offsets[part]
        if dim is not None:
            whole[dim] = self.full_in_features // param.input_pack
        if tuple(loaded.shape) != tuple(whole):
            raise ValueError(f"shape mismatch: checkpoint tensor {tuple(loaded.shape)}, "
                             f"expected {tuple(whole)}")
        if cols and dim is not None:
            pack = param.input_pack
            loaded = _narrow(loaded, dim, cols[0] // pack, cols[1] // pack)
        if cols and dim is None and param is getattr(self, "bias", None) and not self.shard.add_bias:
            loaded = torch.zeros(tuple(loaded.shape), dtype=param.dtype)
        parts = range(len(self.output_sizes)) if part is None else [part]
        if rows is None and part is None:
            return _copy(param, loaded)
        for i in parts:
            first, n = rows[i] if rows else (0, self.output_sizes[i])
            # a whole fused tensor holds every part; a part's tensor only its own rows
            src = first + (self.full_offsets[i] if part is None else 0)
            _copy(param.narrow(0, self.offsets[i], n), _narrow(loaded, 0, src, n))

    def forward(self, x) -> torch.Tensor:
        y = self.method.apply(self, x)
        return self.shard.reduce(y) if self.shard.reduce is not None else y

    def input_from_norm(self, norm: nn.Module, h: torch.Tensor, delta: torch.Tensor | None = None):
        return self.method.input_from_norm(norm, h, delta)

    def input_from_silu_mul(self, gate_up: torch.Tensor, silu_mul):
        return self.method.input_from_silu_mul(gate_up, silu_mul)

    def silu_mul_output(self, x, silu_mul) -> torch.Tensor | None:
        """silu(gate) * up of this layer's output where its method makes it in
        its own call, else None: the caller applies silu_mul to forward's
        output (or the next layer fuses it: input_from_silu_mul)."""
        if not self.silu_mul_after or self.shard.reduce is not None:
            return None
        return self.method.silu_mul_output(self, x, silu_mul)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.output_sizes}, bias={self.has_bias}, "
                f"method={self.method.describe(self)}")


def _offsets(sizes: list[int]) -> list[int]:
    out = [0]
    for n in sizes:
        out.append(out[-1] + n)
    return out


def _narrow(t, dim: int, start: int, length: int):
    """t.narrow; a lazily read tensor (model_loader) reads only that slice later."""
    return t if (start, length) == (0, t.shape[dim]) else t.narrow(dim, start, length)
