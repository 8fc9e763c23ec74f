"""Checkpoint loading: HF safetensors directories and GGUF files, plus tokenizers."""
from qoqserve.errors import ModelLoadError
from qoqserve.models.arch import ModelArchConfig, UnsupportedModelError

from .base import ModelSource
from .source import default_gguf_path, load_model_source
from .tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["IncrementalDetokenizer", "ModelArchConfig", "ModelLoadError", "ModelSource",
           "Tokenizer", "UnsupportedModelError", "default_gguf_path", "load_model_source"]
