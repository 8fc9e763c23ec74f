"""Step-wise engine: add_request / step / abort. The server and LLM drive this."""
from __future__ import annotations

import logging

from qoqserve.config import EngineConfig
from qoqserve.engine.block_manager import BlockManager
from qoqserve.engine.model_runner import ModelRunner
from qoqserve.engine.output import OutputTracker, RequestOutput
from qoqserve.engine.scheduler import Scheduler
from qoqserve.engine.sequence import Sequence
from qoqserve.model_loader import load_model_source
from qoqserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class InvalidRequestError(ValueError):
    pass


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        source = load_model_source(config.model)
        self.model_name = source.name
        self.tokenizer = source.tokenizer
        self.arch = source.arch
        context = config.scheduler.max_model_len or self.arch.max_position_embeddings
        self.quant_config = source.quant_config
        self.runner = ModelRunner(config, self.arch, source.iter_tensors(), max_positions=context,
                                  quant=source.quant_config)
        bs = config.cache.block_size
        # A sequence alone must always fit in the pool, or preemption could not make progress.
        self.max_model_len = min(context, self.runner.num_blocks * bs)
        self.block_manager = BlockManager(self.runner.num_blocks, bs, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len)
        self.eos_ids = set(self.tokenizer.eos_token_ids) | set(self.arch.eos_token_ids)
        self.trackers: dict[str, OutputTracker] = {}
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._runner_stats = self.runner.stats()  # fixed after load; stats() is called every step

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not all(isinstance(t, int) and 0 <= t < self.arch.vocab_size for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {self.arch.vocab_size})")
        return list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None) -> list[int]:
        """Queue a request; returns its prompt token ids. Raises InvalidRequestError."""
        if request_id in self.trackers:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        ids = self.tokenize(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens but the context window is {self.max_model_len} "
                f"tokens (prompt plus at least one generated token must fit)")
        seq = Sequence(request_id, ids, params)
        self.trackers[request_id] = OutputTracker(seq, self.tokenizer, self.eos_ids, self.max_model_len)
        self.scheduler.add(seq)
        return ids

    def abort(self, request_id: str) -> bool:
        tracker = self.trackers.pop(request_id, None)
        if tracker is None:
            return False
        self.scheduler.finish(tracker.seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return []
        tokens, logprobs, top = self.runner.run(seqs, is_prefill)
        if is_prefill:
            self.num_prompt_tokens += sum(len(s) - s.num_cached_tokens for s in seqs)
        self.num_generation_tokens += len(seqs)
        outputs = []
        for i, seq in enumerate(seqs):
            seq.append(tokens[i], logprobs[i] if logprobs is not None else None,
                       top[i] if top is not None else None)
            self.block_manager.on_token_computed(seq)
            tracker = self.trackers[seq.request_id]
            reason = tracker.on_token(tokens[i])
            if reason is not None:
                self.scheduler.finish(seq, reason)
                del self.trackers[seq.request_id]
            outputs.append(tracker.make_output())
        return outputs

    def stats(self) -> dict:
        bm = self.block_manager
        return {
            **self._runner_stats,
            "model": self.model_name, "max_model_len": self.max_model_len,
            "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
            "num_free_blocks": bm.num_free_blocks, "kv_usage": bm.usage,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": bm.prefix_queries, "prefix_cache_hits": bm.prefix_hits,
            "prompt_tokens": self.num_prompt_tokens, "generation_tokens": self.num_generation_tokens,
        }
