"""GGUF files (llama.cpp format) for the llama, qwen2, qwen3, phi3, smollm3 and
granite architectures.

Weights are dequantized to float32 (F16/BF16/F32 stay as stored) and renamed
to HF names. llama.cpp's converter reorders attn_q/attn_k rows of "llama"
models for its RoPE layout; we undo that so every consumer sees HF order.
"""
from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from qoqserve.errors import ModelLoadError
from qoqserve.models.arch import (
    ModelArchConfig,
    UnsupportedModelError,
    longrope_scaling,
    sliding_pattern,
    softcap_of,
    yarn_scaling,
)

from . import gguf_dequant
from .base import ModelSource, TensorIter
from .gguf_header import GGUFTensor, read_gguf_header
from .gguf_tokenizer import tokenizer_from_gguf_metadata
from .lazy import LazyTensor
from .scalar_folds import folds_of, transform_of
from .schema import check_inventory
from .tokenizer_source import load_tokenizer

_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "smollm3": "smollm3",
          "granite": "llama",  # granite: its scales folded into the weights (scalar_folds.py)
          "gemma2": "gemma2", "gemma3": "gemma3"}
# llama.cpp's converter reorders the q/k rows of these for its RoPE layout
_ROPE_PERMUTED = ("llama", "granite", "smollm3")
# llama.cpp's SmolLM3: every 4th layer without RoPE (its GGUF has no key for it)
_SMOLLM3_NOPE_EVERY = 4
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_BLOCK_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
                "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# phi3 stores q/k/v as one attn_qkv and gate/up as one ffn_up (gate rows first)
_FUSED_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Gemma 3's sandwich norms, in HF's names: ffn_norm is the MLP's input norm there
_SANDWICH_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                   "post_ffw_norm": "post_feedforward_layernorm"}
# llama.cpp's Gemma 2 and 3: one global layer in two / six; Gemma 3's sliding
# layers' RoPE base; Gemma 2's soft caps and window where the file has none
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA3_LOCAL_THETA = 10000.0
_GEMMA2_DEFAULTS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "attention.sliding_window": 4096}
# llama.cpp's 27B models (by their layer count) scale the scores by hidden / heads, the others by head_dim
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_QUANT_SUFFIX = re.compile(r"[.-](I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


def hf_tensor_name(gguf_name: str, fused: bool = False, sandwich: bool = False) -> str | None:
    """The HF name of a GGUF tensor (fused: the architecture fuses q/k/v and
    gate/up; sandwich: it has Gemma's norms around attention and the MLP)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    names = {**_BLOCK_NAMES, **(_FUSED_NAMES if fused else {}), **(_SANDWICH_NAMES if sandwich else {})}
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return None


def _no_checks(t: torch.Tensor) -> None:
    """GGUF tensors are float data: no value ranges to check."""


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp convert_hf_to_gguf's `permute`.

    Per head, llama.cpp interleaves the two rotary halves (rows i and i+d/2
    become rows 2i and 2i+1); HF keeps them as two contiguous halves.
    """
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape).contiguous())


def _to_torch(t) -> torch.Tensor:
    # lazy: only GGUF files need the gguf package
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    shape = t.shape
    if t.tensor_type in (Q.F32, Q.F16):
        arr = np.array(t.data)  # copy out of the read-only memmap
    elif t.tensor_type == Q.BF16:
        return torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16).reshape(shape)
    elif t.tensor_type.name in gguf_dequant.fast_formats():
        return gguf_dequant.dequantize(t.data, t.tensor_type.name, tuple(int(n) for n in shape))
    else:
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    return torch.from_numpy(arr).reshape(shape)


def _llama3_factors(factor: float, theta: float, dim: int, orig_ctx: float,
                    low: float = 1.0, high: float = 4.0) -> np.ndarray:
    # the per-frequency divisors llama.cpp's converter stores as rope_freqs
    out = []
    for k in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (k / dim)
        if wavelen < orig_ctx / high:
            out.append(1.0)
        elif wavelen > orig_ctx / low:
            out.append(factor)
        else:
            smooth = (orig_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _context(meta: dict[str, Any], a: str, scaling: dict[str, Any] | None) -> int:
    ctx = int(meta.get(f"{a}.context_length", 4096))
    if scaling is not None and scaling["rope_type"] == "yarn":
        return yarn_scaling(scaling, ctx)[1]
    return ctx


def _rope_scaling(meta: dict[str, Any], a: str, by_name: dict[str, GGUFTensor], theta: float, rotary_dim: int,
                  where: str) -> dict[str, Any] | None:
    kind = meta.get(f"{a}.rope.scaling.type", "none")
    orig = meta.get(f"{a}.rope.scaling.original_context_length")
    rope_freqs = by_name.get("rope_freqs.weight")
    long, short = by_name.get("rope_factors_long.weight"), by_name.get("rope_factors_short.weight")
    if long is not None or short is not None:  # Phi-3 128k, Phi-3.5: LongRoPE, its factors as tensors
        if long is None or short is None:
            raise ModelLoadError(f"{where}: LongRoPE needs both rope_factors_long and rope_factors_short")
        factors = {"long_factor": _to_torch(long).float().reshape(-1).tolist(),
                   "short_factor": _to_torch(short).float().reshape(-1).tolist(),
                   "attention_factor": meta.get(f"{a}.rope.scaling.attn_factor")}
        return longrope_scaling(factors, int(meta.get(f"{a}.context_length", 4096)), orig, rotary_dim // 2)
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta[f"{a}.rope.scaling.factor"])}
    if kind == "yarn":  # the context it reaches is set from it (models/arch.yarn_scaling)
        return {"rope_type": "yarn", "factor": float(meta[f"{a}.rope.scaling.factor"]),
                "original_max_position_embeddings": int(orig or meta.get(f"{a}.context_length", 4096))}
    if kind not in ("none", ""):
        raise UnsupportedModelError(f"{where}: unsupported rope scaling type {kind!r}")
    if rope_freqs is None:
        return None
    # Llama 3.x: only the per-frequency factors are stored; recover the HF
    # parameters (low/high factors are 1 and 4 in every Llama 3 release)
    # and accept them only if they reproduce the stored factors exactly.
    stored = _to_torch(rope_freqs).float().numpy().reshape(-1)
    params = {"rope_type": "llama3", "factor": float(stored.max()), "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": int(orig or 8192)}
    redo = _llama3_factors(params["factor"], theta, rotary_dim,
                           params["original_max_position_embeddings"])
    if redo.shape != stored.shape or not np.allclose(redo, stored, rtol=1e-4, atol=1e-6):
        raise UnsupportedModelError(f"{where}: rope_freqs.weight is not a Llama-3 rope scaling")
    return params


@dataclass(frozen=True)
class _ParsedGGUF:
    """What a GGUF file holds: its metadata decoded to Python values, and its
    tensors (GGUFTensor: views of the file's read-only memory map)."""
    meta: dict[str, Any]
    tensors: list[GGUFTensor]


def _parse(path: str) -> _ParsedGGUF:
    st = os.stat(path)
    return _parse_cached(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _parse_cached(path: str, size: int, mtime_ns: int) -> _ParsedGGUF:
    """Parsed once per process: loading one file again (another engine, eval
    configurations, the tests) should not decode its vocabulary twice. Keyed
    by size and mtime, so a changed file is parsed afresh."""
    return _ParsedGGUF(*read_gguf_header(path))


class GGUFSlice:
    """One GGUF tensor as a LazyTensor's source: indexing by a tuple of slices
    reads (and dequantizes) only those rows, and those columns rounded out to
    whole quantization blocks, from the memory-mapped file. q/k rows come
    un-permuted (unpermute_rope_rows), per head: a row slice is widened to
    whole heads for that, then cut back."""

    def __init__(self, t, shape: tuple[int, ...], head_rows: int | None):
        self._t, self.shape, self._head_rows = t, shape, head_rows

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        rows = index[0]
        hr = self._head_rows
        if hr and (rows.start % hr or rows.stop % hr):
            lo, hi = rows.start // hr * hr, -(-rows.stop // hr) * hr
            return self[(slice(lo, hi), *index[1:])][rows.start - lo:rows.stop - lo]
        if len(self.shape) == 1:
            return torch.from_numpy(np.array(self._t.data[rows], dtype=np.float32))
        w = self._read(rows, index[1])
        return unpermute_rope_rows(w, w.shape[0] // hr) if hr else w

    def _read(self, rows: slice, cols: slice) -> torch.Tensor:
        # lazy: only GGUF files need the gguf package
        from gguf import GGML_QUANT_SIZES
        from gguf import GGMLQuantizationType as Q
        from gguf.quants import dequantize

        t = self._t
        if t.tensor_type in (Q.F32, Q.F16):  # GGUFTensor: elements for these, bytes for the rest
            return torch.from_numpy(np.array(t.data[rows, cols], dtype=np.float32))
        block, nbytes = GGML_QUANT_SIZES[t.tensor_type]
        first, last = cols.start // block, -(-cols.stop // block)
        raw = np.ascontiguousarray(t.data[rows, first * nbytes:last * nbytes])
        if t.tensor_type == Q.BF16:
            return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
        w = np.asarray(dequantize(raw, t.tensor_type), dtype=np.float32)
        off = cols.start - first * block
        return torch.from_numpy(w)[:, off:off + cols.stop - cols.start].contiguous()


def load_gguf(path: str, tok_spec: str | None = None) -> ModelSource:
    """tok_spec: where to take the tokenizer from instead of the file's
    metadata (tokenizer_source.load_tokenizer)."""
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: no such file")
    parsed = _parse(path)
    meta = parsed.meta
    a = meta.get("general.architecture")
    if a not in _ARCHS:
        raise UnsupportedModelError(f"{path}: unsupported GGUF architecture {a!r}; "
                                    f"supported: {sorted(_ARCHS)}")
    by_name = {t.name: t for t in parsed.tensors}

    def need(key: str) -> Any:
        if key not in meta:
            raise ModelLoadError(f"{path}: missing GGUF metadata {key!r}")
        return meta[key]

    hidden, heads = int(need(f"{a}.embedding_length")), int(need(f"{a}.attention.head_count"))
    kv_heads = meta.get(f"{a}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise UnsupportedModelError(f"{path}: per-layer KV head counts are not supported")
    head_dim = int(meta.get(f"{a}.attention.key_length") or hidden // heads)
    rope_dims = int(meta.get(f"{a}.rope.dimension_count") or head_dim)  # below head_dim: e.g. Phi-4-mini's 96 of 128
    if not 0 < rope_dims <= head_dim or rope_dims % 2:
        raise UnsupportedModelError(f"{path}: rope.dimension_count {rope_dims} for heads of {head_dim} channels")
    theta = float(meta.get(f"{a}.rope.freq_base", 10000.0))
    scaling = _rope_scaling(meta, a, by_name, theta, rope_dims, path)
    if "token_embd.weight" not in by_name:
        raise ModelLoadError(f"{path}: missing tensor token_embd.weight")
    layers = int(need(f"{a}.block_count"))
    gemma2 = a == "gemma2"

    def gemma2_key(key: str) -> Any:
        return meta.get(f"{a}.{key}", _GEMMA2_DEFAULTS[key] if gemma2 else None)
    window = int(gemma2_key("attention.sliding_window") or 0) or None
    gemma = {}
    if a in _GEMMA_PATTERN:  # as llama.cpp reads a Gemma file (its norms hold the 1 added already)
        # the pattern: one global layer every n, or (newer converters) a flag per layer
        pattern = meta.get(f"{a}.attention.sliding_window_pattern") or _GEMMA_PATTERN[a]
        sliding = (tuple(i for i, swa in enumerate(pattern) if swa) if isinstance(pattern, list)
                   else sliding_pattern(layers, int(pattern)))
        gemma = dict(mlp_act="gelu_tanh", embed_scale=float(hidden) ** 0.5,
                     attn_scale=(hidden // heads if layers == _GEMMA_27B_LAYERS[a] else head_dim) ** -0.5,
                     attn_softcap=softcap_of(gemma2_key("attn_logit_softcapping")),
                     logit_softcap=softcap_of(gemma2_key("final_logit_softcapping")),
                     sliding_layers=sliding if window else None)
        if not gemma2:
            gemma["rope_local_theta"] = float(meta.get(f"{a}.rope.freq_base_swa") or _GEMMA3_LOCAL_THETA)
    arch = ModelArchConfig(
        architecture=_ARCHS[a],
        vocab_size=int(by_name["token_embd.weight"].dims[1]),
        hidden_size=hidden,
        intermediate_size=int(need(f"{a}.feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        rotary_dim=None if rope_dims == head_dim else rope_dims,
        rms_norm_eps=float(meta.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_context(meta, a, scaling),
        tie_word_embeddings="output.weight" not in by_name,
        attention_bias="blk.0.attn_q.bias" in by_name,
        sliding_window=window,
        nope_layers=tuple(i for i in range(layers) if (i + 1) % _SMOLLM3_NOPE_EVERY == 0) if a == "smollm3" else (),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        **gemma,
    )

    renamed: dict[str, Any] = {}
    for t in parsed.tensors:
        if t.name in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
            continue  # folded into arch.rope_scaling above
        hf = hf_tensor_name(t.name, arch.fused_checkpoint_linears, arch.sandwich_norms)
        if hf is None:
            raise ModelLoadError(f"{path}: unexpected tensor {t.name!r} for a {a} model")
        renamed[hf] = t
    check_inventory(
        arch, None, {n: (t.shape, None)
                     for n, t in renamed.items()}, path)

    if tok_spec is not None:  # the file's eos stays one too: it is what the model was trained to end with
        eos = meta.get("tokenizer.ggml.eos_token_id")
        tok = load_tokenizer(tok_spec, [] if eos is None else [int(eos)], arch.bos_token_id)
        arch.bos_token_id = tok.bos_token_id if tok.bos_token_id is not None else arch.bos_token_id
    else:
        try:
            tok = tokenizer_from_gguf_metadata(meta, path)
        except KeyError as e:
            raise ModelLoadError(f"{path}: missing GGUF tokenizer metadata {e}") from e
    arch.eos_token_ids = list(tok.eos_token_ids)

    def rope_permuted(name: str) -> bool:
        return a in _ROPE_PERMUTED and (".q_proj." in name or ".k_proj." in name)

    folds = folds_of(meta.get(f"{a}.embedding_scale"), meta.get(f"{a}.residual_scale"),
                     meta.get(f"{a}.attention.scale"), meta.get(f"{a}.logit_scale"), head_dim,
                     arch.tie_word_embeddings) if a == "granite" else {}

    def iter_tensors() -> TensorIter:
        for name, t in renamed.items():
            w = _to_torch(t)
            if rope_permuted(name):
                w = unpermute_rope_rows(w, heads if ".q_proj." in name else arch.num_kv_heads)
            transform = transform_of(folds, name, False)  # a GGUF's norms hold Gemma's 1 added
            yield name, w if transform is None else transform(w)

    def iter_lazy() -> TensorIter:
        """Each tensor-parallel rank reads its shard's rows and blocks only."""
        for name, t in renamed.items():
            yield name, LazyTensor(GGUFSlice(t, t.shape, head_dim if rope_permuted(name) else None),
                                   t.shape, _no_checks, transform=transform_of(folds, name, False))

    stem = os.path.basename(path)
    stem = _QUANT_SUFFIX.sub("", stem[:-5] if stem.endswith(".gguf") else stem)
    return ModelSource(path=path, name=stem, arch=arch, tokenizer=tok,
                       tensor_iter_factory=iter_tensors, lazy_iter_factory=iter_lazy)
