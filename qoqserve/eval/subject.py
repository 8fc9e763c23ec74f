"""What the quality metrics measure: anything that scores a prompt and
decodes greedily. Either a model in memory (the FP model or the fake-quant
simulation of a configuration) or the runtime engine on a checkpoint (INT8
GEMMs, KV4 pages, the kernels a server runs)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from qoqserve.eval.generate import greedy_generate
from qoqserve.sampling_params import SamplingParams

# (ids, rows) -> next-token logits after each position in rows; rows None:
# every position but the last
LogitsFn = Callable[[list[int], list[int] | None], torch.Tensor]
# (prompts ids, max new tokens) -> each prompt's greedy continuation (up to EOS)
GenerateFn = Callable[[list[list[int]], int], list[list[int]]]


@dataclass
class Subject:
    name: str
    logits: LogitsFn
    generate: GenerateFn
    info: dict = field(default_factory=dict)   # e.g. quantize seconds, steps


def model_subject(name: str, model, eos_ids: list[int], **info) -> Subject:
    return Subject(name, model.prompt_logits,
                   lambda prompts, n: greedy_generate(model, prompts, n, eos_ids), info)


def engine_subject(name: str, llm, **info) -> Subject:
    """llm: a qoqserve.LLM; greedy requests through its scheduler and pages."""
    def generate(prompts, n):
        return [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n))]
    return Subject(name, llm.engine.prompt_logits, generate, info)
