"""How many positions an engine serves: the context window asked for, else
the model's. Attention here always sees the whole context, which is a
sliding-window model's attention only while the context fits its window, so
the window bounds it (as vLLM's --disable-sliding-window does)."""
from __future__ import annotations

import logging

from qoqserve.config import EngineConfig
from qoqserve.models.arch import ModelArchConfig

log = logging.getLogger(__name__)


def context_len(config: EngineConfig, arch: ModelArchConfig) -> int:
    asked, window = config.scheduler.max_model_len, arch.sliding_window
    if asked and window and asked > window:
        raise ValueError(f"--max-model-len {asked} is longer than the model's sliding attention window "
                         f"({window} tokens): qoqserve's attention is not windowed, so it matches the "
                         f"model only up to {window} tokens; ask for at most that")
    if asked:
        return asked
    return min(arch.max_position_embeddings, window or arch.max_position_embeddings)


def warn_about_context(context: int, config: EngineConfig, arch: ModelArchConfig) -> None:
    """What a user should know of the context chosen (logged once, by rank 0)."""
    trained = arch.max_position_embeddings
    if context > trained:  # llama.cpp warns too; vLLM refuses
        log.warning("--max-model-len %d is past the %d positions the model was trained for: expect "
                    "worse output there", context, trained)
    if not config.scheduler.max_model_len and context < trained:
        log.warning("context window %d tokens, the model's sliding attention window (of its %d "
                    "positions): past it the model would attend to fewer tokens than qoqserve's "
                    "attention does", context, trained)
