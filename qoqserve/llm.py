"""Offline API: LLM(model).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import itertools

from tqdm import tqdm

from qoqserve.config import EngineConfig
from qoqserve.engine.burst import OFFLINE_BURST_SECONDS
from qoqserve.engine.llm_engine import LLMEngine
from qoqserve.engine.output import RequestOutput
from qoqserve.model_loader.chat_template import load_chat_template
from qoqserve.quant.default_checkpoint import resolve_model
from qoqserve.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        """model: a path, None for the embedded model, or a `qoq` alias (the embedded
        model as a QoQ checkpoint, quantized on first use); kwargs: EngineConfig's
        fields and its cache/scheduler fields, flat."""
        self._init(EngineConfig.from_kwargs(resolve_model(model), **kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        """From a whole EngineConfig; config.model must be a path (no alias)."""
        llm = cls.__new__(cls)
        llm._init(config)
        return llm

    def _init(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        # no stream waits on a burst's tokens here: longer bursts (engine/burst.py)
        self.engine.burst_seconds = OFFLINE_BURST_SECONDS
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (also done at exit)."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_default_sampling_params(self) -> SamplingParams:
        """What a prompt without its own SamplingParams gets (vLLM's): the model's
        generation config's sampling defaults (EngineConfig.generation_config)."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: list[int] | None = None) -> list[RequestOutput]:
        """Run prompts to completion with continuous batching; outputs in prompt order.
        priority: one per prompt, with the priority scheduling policy (lower first)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(params, list):
            params = [params or self.get_default_sampling_params()] * len(prompts)
        if len(params) != len(prompts) or (priority is not None and len(priority) != len(prompts)):
            raise ValueError("need one SamplingParams (and one priority, if any) per prompt")
        order = {}
        for prompt, p, rank in zip(prompts, params, priority or [0] * len(prompts)):
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, prompt, p, rank)
            order[rid] = len(order)
        results: list[RequestOutput | None] = [None] * len(order)
        bar = None
        if use_tqdm:
            bar = tqdm(total=len(order), desc="generate", unit="req")
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        if bar:
                            bar.update(1)
        finally:
            if bar:
                bar.close()
            for rid in order:  # an exception mid-run must not leave requests holding pages
                self.engine.abort(rid)
        return results

    def chat(self, conversations: list[dict] | list[list[dict]],
             params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False, *, chat_template: str | None = None,
             chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """Each conversation through the chat template (vLLM's LLM.chat options:
        chat_template, a file or the template text, in place of the engine's;
        chat_template_kwargs, more variables for it; continue_final_message,
        the last message continued instead of a new turn begun)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        template = load_chat_template(chat_template) if chat_template is not None else None
        prompts = [self.tokenizer.apply_chat_template(
            c, add_generation_prompt, continue_final_message=continue_final_message, chat_template=template,
            template_kwargs=chat_template_kwargs) for c in conversations]
        # the template already carries BOS where the model wants one
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(ids, params, use_tqdm)
