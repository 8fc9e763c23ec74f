"""How many positions an engine serves: the context window asked for, else
the model's. A sliding-window model is served to its full context: its
layers' attention slides (layers/attention.py), as it was trained."""
from __future__ import annotations

import logging

from qoqserve.config import EngineConfig
from qoqserve.models.arch import ModelArchConfig

log = logging.getLogger(__name__)


def context_len(config: EngineConfig, arch: ModelArchConfig) -> int:
    return config.scheduler.max_model_len or arch.max_position_embeddings


def warn_about_context(context: int, config: EngineConfig, arch: ModelArchConfig) -> None:
    """What a user should know of the context chosen (logged once, by rank 0)."""
    trained = arch.max_position_embeddings
    if context > trained:  # llama.cpp warns too; vLLM refuses
        log.warning("--max-model-len %d is past the %d positions the model was trained for: expect "
                    "worse output there", context, trained)
