"""Checkpoint loading: HF safetensors directories and GGUF files, plus tokenizers."""
from .arch import ModelArchConfig, UnsupportedModelError
from .errors import ModelLoadError
from .source import ModelSource, default_gguf_path, load_model_source
from .tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["IncrementalDetokenizer", "ModelArchConfig", "ModelLoadError", "ModelSource",
           "Tokenizer", "UnsupportedModelError", "default_gguf_path", "load_model_source"]
