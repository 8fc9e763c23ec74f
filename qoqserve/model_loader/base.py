"""What every checkpoint reader hands the engine: a `ModelSource`, i.e.
architecture + tokenizer + lazily streamed tensors under HF Llama names."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from qoqserve.errors import ModelLoadError
from qoqserve.layers.quantization import QuantizationConfig, UnquantizedConfig
from qoqserve.models.arch import ModelArchConfig

from .tokenizer import Tokenizer

TensorIter = Iterator[tuple[str, torch.Tensor]]


def read_json_object(path: str) -> dict[str, Any]:
    """A checkpoint's JSON file that must hold an object; errors name the file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


@dataclass
class ModelSource:
    path: str  # resolved path (dir or .gguf file)
    name: str  # short model name for display/API
    arch: ModelArchConfig
    tokenizer: Tokenizer
    # Opens the checkpoint afresh on each call so tensors stream one at a time
    tensor_iter_factory: Callable[[], TensorIter] = field(repr=False, compare=False,
                                                          default=lambda: iter(()))
    # the checkpoint's quantization scheme (from its quant_config.json, docs/format.md)
    quant_config: QuantizationConfig = field(default_factory=UnquantizedConfig)
    # the same tensors as LazyTensors (model_loader/lazy.py), where the format can read a slice
    lazy_iter_factory: Callable[[], TensorIter] | None = field(repr=False, compare=False, default=None)
    # its own sampling defaults (generation_config.json's keys that vLLM reads: model_loader/generation_config.py)
    generation_config: dict = field(default_factory=dict)

    def iter_tensors(self, lazy: bool = False) -> TensorIter:
        """Yield (HF name, tensor) pairs, one tensor materialized at a time;
        lazy: LazyTensors where the format supports it (tensor-parallel ranks
        then read only their slices), plain tensors elsewhere."""
        if lazy and self.lazy_iter_factory is not None:
            return self.lazy_iter_factory()
        return self.tensor_iter_factory()
