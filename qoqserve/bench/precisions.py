"""The precisions the benchmarks compare, and how each maps to an engine.

A precision fixes the weight format, the activation dtype and the KV-page
format. W4A8 precisions need a QoQ checkpoint: `qoq` (the embedded model,
quantized on first use), a `qoqserve quantize` directory, or a synthetic
model, which gets synthetic QoQ weights.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from qoqserve.model_loader.synthetic import ARCHS, is_synthetic, synthetic_arch


@dataclass(frozen=True)
class Precision:
    name: str
    dtype: str     # activations and unquantized weights; "auto": fp32 on CPU, fp16 on GPU
    weights: str   # "fp" | "w8a8" (quantized at load) | "qoq" (W4A8 checkpoint)
    kv: str        # kv_cache_dtype; "16bit": fp16 on GPU, bf16 on CPU


PRECISIONS = {p.name: p for p in (
    Precision("fp32", "float32", "fp", "auto"),
    Precision("fp16", "float16", "fp", "auto"),
    Precision("bf16", "bfloat16", "fp", "auto"),
    Precision("w8a8", "auto", "w8a8", "16bit"),
    Precision("w4a8", "auto", "qoq", "16bit"),
    Precision("w4a8kv8", "auto", "qoq", "int8"),
    Precision("w4a8kv4", "auto", "qoq", "int4"),
    # the same checkpoint with bf16 activations between the INT8 GEMMs (CPU)
    Precision("w4a8kv4-bf16", "bfloat16", "qoq", "int4"),
)}
UNSUPPORTED = {"w4a16": "W4A16 (weight-only 4-bit) is not implemented in qoqserve"}


def get_precision(name: str) -> Precision:
    if name in UNSUPPORTED:
        raise ValueError(UNSUPPORTED[name])
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}; choose from {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


def _is_qoq_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(os.path.expanduser(path), "quant_config.json"))


def model_for(p: Precision, model: str | None) -> str | None:
    """The checkpoint to load for precision p, given the model the user named."""

    if p.weights != "qoq":
        if model and (_is_qoq_dir(model) or model.lower().startswith("qoq")):
            raise ValueError(f"{p.name} needs full-precision weights; {model!r} is a QoQ checkpoint")
        return model
    if model is None:
        return "qoq"
    if is_synthetic(model):
        name = model.split(":")[1]
        if name not in ARCHS:
            raise ValueError(f"unknown synthetic model {name!r}")
        a = synthetic_arch(name)
        group = 128 if all(d % 128 == 0 for d in (a.hidden_size, a.intermediate_size)) else 64
        return f"synthetic:{name}:qoq-g{group}"
    if model.lower().startswith("qoq") or _is_qoq_dir(model):
        return model
    raise ValueError(f"{p.name} needs a QoQ checkpoint: run `qoqserve quantize {model} -o DIR` "
                     "and pass DIR (or use `qoq` for the embedded model)")


def engine_kwargs(p: Precision, device: str) -> dict:
    kw = {"dtype": p.dtype, "device": device}
    if p.weights == "w8a8":
        kw["quantization"] = "w8a8"
    if p.kv == "16bit":
        kw["kv_cache_dtype"] = "float16" if device.startswith("cuda") else "bfloat16"
    elif p.kv != "auto":
        kw["kv_cache_dtype"] = p.kv
    return kw
