"""What a QoQ W4A8 checkpoint directory must hold, and checks of its values.

Layout and meaning of every tensor: docs/format.md. Shapes and dtypes are
checked from the safetensors headers before anything is read; value ranges
are checked as each tensor streams in, naming the tensor at fault.
"""
from __future__ import annotations

from typing import Any

import torch

from qoqserve.layers.qoq_linear import qoq_param_shapes
from qoqserve.models.arch import ModelArchConfig

from .errors import ModelLoadError

FORMAT_NAME = "qoq-w4a8"
FORMAT_VERSION = 2
# version 2 added the optional per-layer key transform (quant_config "key_transform")
READABLE_VERSIONS = (1, 2)
_ST_DTYPE = {torch.uint8: "U8", torch.float16: "F16"}
_FLOAT = {"F32", "F16", "BF16"}


def quant_group_size(quant: dict[str, Any], where: str) -> int:
    if quant.get("format") != FORMAT_NAME:
        raise ModelLoadError(f"{where}: format {quant.get('format')!r} is not {FORMAT_NAME!r}")
    if quant.get("version") not in READABLE_VERSIONS:
        raise ModelLoadError(f"{where}: format version {quant.get('version')!r} is not supported "
                             f"(this qoqserve reads versions {', '.join(map(str, READABLE_VERSIONS))})")
    if not isinstance(quant.get("key_transform", False), bool):
        raise ModelLoadError(f"{where}: key_transform must be true or false")
    g = quant.get("group_size")
    if not isinstance(g, int) or g < 0:
        raise ModelLoadError(f"{where}: invalid group_size {g!r}")
    return g


def uses_key_transform(quant: dict[str, Any] | None) -> bool:
    """The checkpoint's attention has a KeyTransform (layers/key_transform.py)."""
    return bool(quant and quant.get("key_transform", False))


def linear_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """Fused linear name -> (out_features, in_features)."""
    h, inter = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    out = {}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj"] = (q + 2 * kv, h)
        out[p + "self_attn.o_proj"] = (h, q)
        out[p + "mlp.gate_up_proj"] = (2 * inter, h)
        out[p + "mlp.down_proj"] = (h, inter)
    return out


def expected_tensors(arch: ModelArchConfig, group_size: int,
                     key_transform: bool = False) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """name -> (shape, safetensors dtype or None for any float)."""

    h = arch.hidden_size
    exp: dict[str, tuple[tuple[int, ...], str | None]] = {
        "model.embed_tokens.weight": ((arch.vocab_size, h), None), "model.norm.weight": ((h,), None)}
    if not arch.tie_word_embeddings:
        exp["lm_head.weight"] = ((arch.vocab_size, h), None)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        exp[p + "input_layernorm.weight"] = ((h,), None)
        exp[p + "post_attention_layernorm.weight"] = ((h,), None)
        if key_transform:
            exp[p + "self_attn.key_transform.shift"] = ((arch.num_kv_heads, arch.head_dim), None)
            exp[p + "self_attn.key_transform.rotation"] = ((arch.head_dim, arch.head_dim), None)
    for name, (n, k) in linear_shapes(arch).items():
        for pname, (shape, dtype) in qoq_param_shapes(n, k, group_size).items():
            exp[f"{name}.{pname}"] = (tuple(shape), _ST_DTYPE[dtype])
        if arch.attention_bias and name.endswith("qkv_proj"):
            exp[f"{name}.bias"] = ((n,), None)
    return exp


def check_inventory(arch: ModelArchConfig, group_size: int,
                    found: dict[str, tuple[str, tuple[int, ...]]], where: str,
                    key_transform: bool = False) -> None:
    exp = expected_tensors(arch, group_size, key_transform)
    missing = sorted(set(exp) - set(found))
    extra = sorted(set(found) - set(exp))
    if missing:
        raise ModelLoadError(f"{where}: missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    if extra:
        raise ModelLoadError(f"{where}: unexpected tensor(s) {extra[:3]} for a QoQ checkpoint")
    for name, (shape, dtype) in exp.items():
        got_dtype, got_shape = found[name]
        if tuple(got_shape) != shape:
            raise ModelLoadError(f"{where}: tensor {name} has shape {list(got_shape)}, expected {list(shape)}")
        if (dtype is None and got_dtype not in _FLOAT) or (dtype is not None and got_dtype != dtype):
            raise ModelLoadError(f"{where}: tensor {name} has dtype {got_dtype}, "
                                 f"expected {dtype or 'a float type'}")


def check_values(name: str, t: torch.Tensor, where: str) -> None:
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
