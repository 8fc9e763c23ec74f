"""A tokenizer from somewhere other than the model (vLLM's `--tokenizer`):
an HF tokenizer directory, a Hugging Face id the local cache holds, or a
GGUF file's tokenizer. For a GGUF whose own tokenizer qoqserve does not
build (one that is neither byte-level BPE nor SentencePiece BPE, e.g. a
T5-style unigram) this is the way to run it."""
from __future__ import annotations

import os

from qoqserve.errors import ModelLoadError

from .gguf_header import read_gguf_header
from .gguf_tokenizer import tokenizer_from_gguf_metadata
from .hub_cache import local_path
from .tokenizer import Tokenizer, tokenizer_from_hf_dir


def load_tokenizer(spec: str, eos_ids: list[int], bos_id: int | None) -> Tokenizer:
    """eos_ids, bos_id: the model's (its config's); the tokenizer's own are added."""
    path, _ = local_path(spec)
    if os.path.isdir(path):
        return tokenizer_from_hf_dir(path, eos_ids, bos_id)
    if os.path.isfile(path):
        meta, _ = read_gguf_header(path)
        tok = tokenizer_from_gguf_metadata(meta, path)
        tok.eos_token_ids = list(dict.fromkeys(eos_ids + tok.eos_token_ids))
        return tok
    raise ModelLoadError(f"{path}: no such tokenizer directory or GGUF file (tokenizer {spec!r})")
