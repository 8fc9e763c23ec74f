"""Shared pytest fixtures.

Anything slow to build (the embedded model, transformers' view of it) is
session-scoped so every test module can reuse it.
"""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct Q4_1 GGUF.

    Not skipped when missing: scripts/bootstrap.sh installs it, and a suite that
    silently skipped the real-model tests would pass without testing anything.
    """
    from qoqserve.model_loader import default_gguf_path

    return default_gguf_path()


@pytest.fixture(scope="session")
def default_source(default_gguf_path):
    """Our ModelSource for the embedded GGUF."""
    from qoqserve.model_loader import load_model_source

    return load_model_source(default_gguf_path)


@pytest.fixture(scope="session")
def hf_gguf_model(default_gguf_path):
    """transformers' LlamaForCausalLM loaded (dequantized, FP32) from the embedded GGUF."""
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(default_gguf_path)
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=f).eval()


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(default_gguf_path):
    """transformers' tokenizer built from the embedded GGUF's metadata."""
    from transformers import AutoTokenizer

    d, f = os.path.split(default_gguf_path)
    return AutoTokenizer.from_pretrained(d, gguf_file=f)
