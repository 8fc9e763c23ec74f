"""A model's own sampling defaults, as vLLM takes them: from the checkpoint's
generation_config.json (Hugging Face's), the keys vLLM reads
(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), used
where a request leaves them out. `--generation-config vllm` ignores the
file; a folder reads that folder's; `--override-generation-config` sets keys
over either.
"""
from __future__ import annotations

import json
import os
from typing import Any

from qoqserve.config import json_object
from qoqserve.sampling_params import InvalidSamplingParams, SamplingParams

from .base import read_json_object

FILE = "generation_config.json"
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def read_generation_config(folder: str) -> dict[str, Any]:
    """The sampling keys of folder/generation_config.json ({} without one)."""
    path = os.path.join(folder, FILE)
    return sampling_keys(read_json_object(path)) if os.path.isfile(path) else {}


def sampling_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """The keys of a generation config that vLLM takes as sampling defaults."""
    return {k: raw[k] for k in SAMPLING_KEYS if raw.get(k) is not None}


def write_generation_config(folder: str, source) -> None:
    """folder/generation_config.json for a checkpoint made from `source` (a
    ModelSource): its BOS/EOS ids and its sampling defaults."""
    arch = source.arch
    body = {"bos_token_id": arch.bos_token_id, "eos_token_id": arch.eos_token_ids, **source.generation_config}
    with open(os.path.join(folder, FILE), "w") as f:
        json.dump(body, f, indent=2)


def sampling_defaults(mode: str, model_config: dict[str, Any],
                      override: str | dict | None = None) -> dict[str, Any]:
    """SamplingParams fields a request that leaves them out gets. mode: "auto"
    (the model's generation config, `model_config`), "vllm" (none: vLLM's and
    OpenAI's defaults) or a folder holding a generation_config.json."""
    if mode == "auto":
        config = dict(model_config)
    elif mode == "vllm":
        config = {}
    elif os.path.isdir(mode):
        config = read_generation_config(mode)
    else:
        raise ValueError(f"generation_config must be auto, vllm or a folder holding {FILE}, got {mode!r}")
    override = json_object(override, "override_generation_config")
    unknown = set(override or {}) - set(SAMPLING_KEYS)
    if unknown:
        raise ValueError(f"override_generation_config: unknown keys {sorted(unknown)} (known: "
                         f"{', '.join(SAMPLING_KEYS)})")
    config.update(override or {})
    defaults = {("max_tokens" if k == "max_new_tokens" else k): v for k, v in config.items()}
    try:
        SamplingParams(**defaults)
    except (InvalidSamplingParams, TypeError) as e:
        raise ValueError(f"the generation config's sampling defaults {defaults} are not valid: {e}") from None
    return defaults
