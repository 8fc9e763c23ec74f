"""QoQ W4A8 checkpoints (format: docs/format.md), the runtime config.

`QoQConfig.from_config(quant_config.json)` validates the format fields;
`to_config()` is what the quantizer's writer puts in the file; the tensors of
one linear and their value ranges are defined here and nowhere else.
"""
from __future__ import annotations

import re
from typing import Any, Callable

import torch

from qoqserve.errors import ModelLoadError
from qoqserve.layers.linear import LinearMethod
from qoqserve.layers.quantization.base import KernelChoice, QuantizationConfig
from qoqserve.layers.quantization.qoq_methods import (
    QoQInt8Method,
    QoQPackedMethod,
    QoQPerCallMethod,
    QoQSimMethod,
    QoQTritonMethod,
)
from qoqserve.layers.quantization.w8a8 import W8A8LinearMethod

FORMAT_NAME = "qoq-w4a8"
FORMAT_VERSION = 2
# version 2 added the optional per-layer key transform ("key_transform")
READABLE_VERSIONS = (1, 2)
_METHODS = {"packed": QoQPackedMethod, "torch-int8": QoQInt8Method, "torch-int8-percall": QoQPerCallMethod,
            "sim": QoQSimMethod, "triton": QoQTritonMethod}
_KV_FORMATS = {4: "int4", 8: "int8", 16: None}
# a linear of the model by its fused name, as w8a8_linears lists them
_LINEAR_NAME = re.compile(r"layers\.\d+\.(self_attn\.(qkv_proj|o_proj)|mlp\.(gate_up_proj|down_proj))")


class QoQConfig(QuantizationConfig):
    name = "qoq"
    stores_fused_linears = True  # the quantizer works on the model's fused linears
    # per-channel INT8 costs QoQ +0.09% perplexity and KL 0.001 for a quarter
    # of the bf16 head's time at batch 32 (docs/accuracy.md, LM head)
    int8_lm_head = True

    def __init__(self, group_size: int, kv_bits: int = 4, key_transform: bool = False,
                 w8a8_linears: tuple[str, ...] = ()):
        """w8a8_linears: linears stored as fp16 weights and run as W8A8 (per-channel
        INT8 weights quantized at load, per-token INT8 activations), by name
        ("layers.3.mlp.down_proj"); every other linear is W4A8."""
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 0:
            raise ValueError(f"invalid group_size {group_size!r}")
        if kv_bits not in _KV_FORMATS:
            raise ValueError(f"kv_bits must be 4, 8 or 16, got {kv_bits!r}")
        self.group_size = group_size
        self.kv_bits = kv_bits
        self.kv_format = _KV_FORMATS[kv_bits]
        self.key_transform = key_transform
        bad = [n for n in w8a8_linears if not isinstance(n, str) or not _LINEAR_NAME.fullmatch(n)]
        if bad:
            raise ValueError(f"w8a8_linears: {bad[0]!r} is not a linear name such as 'layers.0.mlp.down_proj'")
        self.w8a8_linears = tuple(sorted(set(w8a8_linears)))

    def __repr__(self) -> str:
        return f"QoQConfig(group_size={self.group_size}, kv_bits={self.kv_bits}, " \
               f"key_transform={self.key_transform}, w8a8_linears={len(self.w8a8_linears)})"

    @classmethod
    def from_config(cls, quant: dict[str, Any], where: str) -> "QoQConfig":
        if not isinstance(quant, dict) or quant.get("format") != FORMAT_NAME:
            got = quant.get("format") if isinstance(quant, dict) else quant
            raise ModelLoadError(f"{where}: format {got!r} is not {FORMAT_NAME!r}")
        if quant.get("version") not in READABLE_VERSIONS:
            raise ModelLoadError(f"{where}: format version {quant.get('version')!r} is not supported "
                                 f"(this qoqserve reads versions {', '.join(map(str, READABLE_VERSIONS))})")
        key_transform = quant.get("key_transform", False)
        if not isinstance(key_transform, bool):
            raise ModelLoadError(f"{where}: key_transform must be true or false")
        w8a8 = quant.get("w8a8_linears", [])
        if not isinstance(w8a8, list):
            raise ModelLoadError(f"{where}: w8a8_linears must be a list of linear names")
        try:
            return cls(quant.get("group_size"), quant.get("kv_bits", 16), key_transform, tuple(w8a8))
        except ValueError as e:
            raise ModelLoadError(f"{where}: {e}") from None

    def to_config(self) -> dict:
        return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "method": self.name,
                "group_size": self.group_size, "w_bits": 4, "a_bits": 8, "kv_bits": self.kv_bits,
                "key_transform": self.key_transform,
                **({"w8a8_linears": list(self.w8a8_linears)} if self.w8a8_linears else {})}

    def get_linear_method(self, choice: KernelChoice | None = None) -> LinearMethod:
        choice = choice or KernelChoice(w4a8="sim")
        if choice.w4a8 not in _METHODS:
            raise ValueError(f"unknown W4A8 backend {choice.w4a8!r}; choose from {tuple(_METHODS)}")
        return _METHODS[choice.w4a8](self.group_size, cpu_ops=choice.cpu_ops,
                                     fused=choice.fused_int8)

    def linear_methods(self, choice: KernelChoice | None = None) -> Callable[[str], LinearMethod]:
        w4a8 = self.get_linear_method(choice)
        if not self.w8a8_linears:
            return lambda name: w4a8
        choice = choice or KernelChoice()
        w8a8 = W8A8LinearMethod(cpu_ops=choice.cpu_ops, fused=choice.fused_int8)
        kept = set(self.w8a8_linears)
        return lambda name: w8a8 if name in kept else w4a8

    def float_storage_dtype(self, name: str) -> torch.dtype:
        # fp16 would break the key rotation's orthogonality
        return torch.float32 if name.endswith("key_transform.rotation") else torch.float16

    def check_tensor(self, name: str, t: torch.Tensor, where: str) -> None:
        """Ranges that the integer kernels rely on; a violation would compute garbage."""
        def bad(msg: str):
            raise ModelLoadError(f"{where}: tensor {name}: {msg}")

        if t.is_floating_point() and not torch.isfinite(t).all():
            bad("contains NaN or Inf")
        if name.endswith(".s1") and not (t > 0).all():
            bad("channel scales must be positive")
        if name.endswith(".zeros") and int(t.max()) > 15:
            bad(f"zero points must be in 0..15, found {int(t.max())}")
        if name.endswith(".s2") and (int(t.min()) < 1 or int(t.max()) > 127):
            bad(f"group scales must be in 1..127, found {int(t.min())}..{int(t.max())}")
