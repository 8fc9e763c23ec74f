"""Quantization schemes: one config object per scheme (base.py), made from a
checkpoint's quant_config.json or from the engine's --quantization flag."""
from __future__ import annotations

from qoqserve.errors import ModelLoadError
from qoqserve.layers.quantization.base import KernelChoice, QuantizationConfig
from qoqserve.layers.quantization.fp import UnquantizedConfig
from qoqserve.layers.quantization.qoq import FORMAT_NAME as QOQ_FORMAT
from qoqserve.layers.quantization.qoq import QoQConfig
from qoqserve.layers.quantization.w8a8 import W8A8Config

# quant_config.json "format" -> the scheme that reads it
CHECKPOINT_FORMATS = {QOQ_FORMAT: QoQConfig}
# --quantization NAME: schemes applied to a full-precision checkpoint at load
AT_LOAD = {"w8a8": W8A8Config}

__all__ = ["AT_LOAD", "CHECKPOINT_FORMATS", "KernelChoice", "QoQConfig", "QuantizationConfig",
           "UnquantizedConfig", "W8A8Config", "config_from_file", "resolve_quantization"]


def config_from_file(quant: dict | None, where: str) -> QuantizationConfig:
    """The scheme of a checkpoint from its quant_config.json (None: full precision)."""
    if quant is None:
        return UnquantizedConfig()
    fmt = quant.get("format") if isinstance(quant, dict) else None
    cls = CHECKPOINT_FORMATS.get(fmt)
    if cls is None:
        raise ModelLoadError(f"{where}: format {fmt!r} is not {' or '.join(map(repr, CHECKPOINT_FORMATS))}")
    return cls.from_config(quant, where)


def resolve_quantization(checkpoint: QuantizationConfig, requested: str | None) -> QuantizationConfig:
    """What the engine runs: the checkpoint's scheme, or one applied at load."""
    if requested is None:
        return checkpoint
    if requested not in AT_LOAD:
        raise ValueError(f"unknown --quantization {requested!r} (only {', '.join(AT_LOAD)} is "
                         "applied at load; QoQ W4A8 needs a checkpoint from `qoqserve quantize`)")
    if not isinstance(checkpoint, UnquantizedConfig):
        raise ValueError(f"--quantization {requested} needs a full-precision checkpoint; this one "
                         f"is already quantized ({checkpoint.name})")
    return AT_LOAD[requested]()
