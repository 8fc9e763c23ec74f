"""Step-wise engine: add_request / step / abort. The server and LLM drive this."""
from __future__ import annotations

import logging

import torch

from qoqserve.config import EngineConfig
from qoqserve.engine import burst
from qoqserve.engine.admission import Admission, PreparedRequest
from qoqserve.engine.block_manager import BlockManager
from qoqserve.engine.context_window import context_len, warn_about_context
from qoqserve.engine.executor import TensorParallelExecutor
from qoqserve.engine.isolation import StepIsolation
from qoqserve.engine.model_runner import ModelRunner
from qoqserve.engine.output import OutputTracker, RequestOutput
from qoqserve.engine.scheduler import ScheduledBatch, Scheduler
from qoqserve.engine.sequence import Sequence
from qoqserve.engine.speculative import Speculator, per_step
from qoqserve.engine.structured import GrammarCompiler, GrammarConstraint
from qoqserve.engine.window_pages import WindowPages
from qoqserve.errors import InvalidRequestError
from qoqserve.layers.token_logprobs import scored_token_logprobs
from qoqserve.model_loader import load_model_source
from qoqserve.model_loader.chat_template import load_chat_template
from qoqserve.model_loader.generation_config import sampling_defaults
from qoqserve.model_loader.schema import check_parallel_fit
from qoqserve.sampling_params import SamplingParams

__all__ = ["InvalidRequestError", "LLMEngine", "PreparedRequest"]

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        source = load_model_source(config.model, config.tokenizer)
        self.model_name = source.name
        self.tokenizer = source.tokenizer
        if config.chat_template is not None:  # read and compiled now: a bad one fails the start, naming it
            self.tokenizer.chat_template = load_chat_template(config.chat_template)
        self.arch = source.arch
        # what a request leaves out of its sampling settings (checked now: a bad file fails the start)
        self.sampling_defaults = sampling_defaults(config.generation_config, source.generation_config,
                                                   config.override_generation_config)
        if self.sampling_defaults:
            log.info("sampling defaults from the generation config: %s (--generation-config vllm "
                     "ignores them)", self.sampling_defaults)
        context = context_len(config, self.arch)
        warn_about_context(context, config, self.arch)
        self.quant_config = source.quant_config
        self.executor = None
        tp = config.parallel.tensor_parallel_size
        if tp != 1:
            # every rank's shapes are rank 0's: a size that cannot split this
            # model fails here, before any worker starts
            check_parallel_fit(self.arch, source.quant_config, tp)
            self.executor = TensorParallelExecutor(config)
        try:
            self.runner = ModelRunner(config, self.arch, source.iter_tensors(lazy=tp != 1),
                                      max_positions=context,
                                      quant=source.quant_config, executor=self.executor,
                                      world=self.executor.world if self.executor else None)
        except Exception:
            self.shutdown()
            raise
        bs = config.cache.block_size
        # A sequence alone must always fit in the pool, or preemption could not make progress.
        self.max_model_len = min(context, self.runner.num_blocks * bs)
        window_pages = None
        if self.runner.num_window_pages is not None:  # the sliding layers have a pool of their own
            window_pages = WindowPages(self.runner.num_window_pages)
            self.runner.page_updates = window_pages.take_updates
        self.block_manager = BlockManager(self.runner.num_blocks, bs, config.cache.enable_prefix_caching,
                                          self.arch.window_of_every_layer if window_pages is None
                                          else self.arch.sliding_window, window_pages)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len)
        sched = config.scheduler
        self.eos_ids = set(self.tokenizer.eos_token_ids) | set(self.arch.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, self.arch.vocab_size, sorted(self.eos_ids),
                                        max_whitespace=config.structured_outputs_max_whitespace)
        self.admission = Admission(self.tokenizer, self.arch.vocab_size, self.max_model_len,
                                   sched.max_prompt_tokens, sched.max_tokens_limit, self.grammars,
                                   self.sampling_defaults, sched.scheduling_policy == "priority")
        self.trackers: dict[str, OutputTracker] = {}
        self.isolation = StepIsolation(self.runner)
        spec = config.speculative()
        graphs = self.runner.decode_graphs()
        self.speculator = (Speculator(spec, self.block_manager, self.max_model_len,
                                      graphs.max_size if graphs is not None else sched.max_num_seqs)
                           if spec is not None else None)
        # failures of steps: pinned on (and ended only) one request, or not
        # (every request of the step ended); /health reports them
        self.num_request_faults = 0
        self.num_engine_faults = 0
        self.last_engine_fault: str | None = None
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_bursts = 0  # decode bursts run (engine/burst.py)
        self.burst_seconds = burst.BURST_SECONDS  # most time one burst may take
        self._runner_stats = self.runner.stats()  # fixed after load; stats() is called every step

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Prompt token ids (validated); pure, so any thread may call it."""
        return self.admission.tokenize(prompt)

    def prepare_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                        max_tokens_must_fit: bool = False, add_special_tokens: bool = True,
                        priority: int = 0) -> PreparedRequest:
        """Admission checks without queueing (pure: any thread may call it); raises
        InvalidRequestError. add_request takes the result without checking again."""
        return self.admission.prepare(prompt, params, max_tokens_must_fit, add_special_tokens, priority)

    def add_request(self, request_id: str, prompt: str | list[int] | PreparedRequest,
                    params: SamplingParams | None = None, priority: int = 0) -> list[int]:
        """Queue a request; returns its prompt token ids. Raises InvalidRequestError.
        priority: with the priority policy, lower runs first (vLLM's)."""
        if request_id in self.trackers:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        req = (prompt if isinstance(prompt, PreparedRequest)
               else self.prepare_request(prompt, params, priority=priority))
        seq = Sequence(request_id, list(req.prompt_token_ids), req.params,
                       constraint=GrammarConstraint(req.grammar) if req.grammar is not None else None,
                       bad_words_ids=req.bad_words_ids, priority=req.priority)
        tracker = self.trackers[request_id] = OutputTracker(seq, self.tokenizer, self.eos_ids, self.max_model_len)
        if req.params.min_tokens:
            seq.stop_bans = tuple(sorted(tracker.stop_token_ids))
        self.scheduler.add(seq)
        return seq.token_ids[:seq.num_prompt_tokens]

    def abort(self, request_id: str) -> bool:
        tracker = self.trackers.pop(request_id, None)
        if tracker is None:
            return False
        self._finish(tracker.seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One step (or a burst of decode steps: engine/burst.py). A failure in
        it ends only the requests that caused it (finish_reason "error";
        engine/isolation.py); the rest go on."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        outputs = self._speculate(batch) if self.speculator is not None else None
        if outputs is None:
            outputs = self._burst(batch)
        if outputs is not None:
            return outputs
        res = self.isolation.run(batch)
        outputs = [self._fail(rid, err) for rid, err in res.failed.items()]
        if res.failed:
            if res.pinned:
                self.num_request_faults += len(res.failed)
            else:
                self.num_engine_faults += 1
                err = next(iter(res.failed.values()))
                self.last_engine_fault = f"{type(err).__name__}: {err}"
        batch = res.batch
        self.num_prompt_tokens += sum(n for _, n in batch.prefills)
        self.num_generation_tokens += len(res.tokens)
        for i, seq in enumerate(self.scheduler.postprocess(batch, res.tokens, res.logprobs, res.top)):
            ended = self._take(seq, res.tokens[i])
            outputs.append(ended if ended is not None else self.trackers[seq.request_id].make_output())
        return outputs

    def _burst(self, batch: ScheduledBatch) -> list[RequestOutput] | None:
        """The batch's decodes as a burst of steps, their tokens taken one step
        after the other; None where it runs as a single step instead."""
        rows = len(batch.decodes)
        n = burst.burst_length(batch, bool(self.scheduler.waiting), self.config.scheduler.num_scheduler_steps,
                               self.max_model_len, self.runner.step_seconds(rows), self.burst_seconds)
        if n < 2 or not self.block_manager.reserve(batch.decodes, n - 1):
            return None
        try:
            res = self.runner.run_burst(batch, n)
        except Exception:  # a kernel refused, memory ran out: the step runs again alone, isolated as ever
            log.exception("a decode burst failed; running the step alone")
            return None
        if res is None:
            return None
        self.num_bursts += 1
        return self._take_steps(batch.decodes, res.tokens, res.logprobs, res.top)

    def _speculate(self, batch: ScheduledBatch) -> list[RequestOutput] | None:
        """The batch's decodes with the drafts the speculator has for them
        (engine/speculative.py); None where it has none (or the step failed:
        it runs again as a plain one, where isolation finds the culprit)."""
        drafts = self.speculator.drafts(batch)
        if drafts is None:
            return None
        try:
            (tokens, lps, tops), after = self.runner.run_verify(batch, drafts)
        except Exception:
            log.debug("a speculative step failed; running it as a plain step", exc_info=True)
            self.runner.rollback()
            return None
        taken = self.speculator.accept(batch.decodes, tokens, drafts, [[t for t, _, _ in a] for a in after])
        steps = max(len(t) for t in taken)
        grid = [[t[s] if s < len(t) else None for t in taken] for s in range(steps)]
        return self._take_steps(batch.decodes, grid, per_step(lps, after, steps, 1), per_step(tops, after, steps, 2))

    def _take_steps(self, decodes: list[Sequence], tokens: list[list[int | None]],
                    logprobs: list[list] | None = None, top: list[list] | None = None) -> list[RequestOutput]:
        """Tokens computed ahead, taken one step after the other as single steps
        would take them: tokens[s][i] is decodes[i]'s at step s (None: it has no
        more); a request that ends takes no more."""
        outputs, alive = [], list(range(len(decodes)))
        params = [s.params for s in decodes]
        for s, step_tokens in enumerate(tokens):
            rows = [i for i in alive if step_tokens[i] is not None]
            # a step's logprobs as a single step returns them: only for the rows that ask
            lps = None if logprobs is None else [logprobs[s][i] if params[i].logprobs else None for i in rows]
            tops = None if top is None else [top[s][i][:params[i].top_logprobs] if params[i].logprobs
                                             else None for i in rows]
            seqs = self.scheduler.postprocess(ScheduledBatch([decodes[i] for i in rows]),
                                              [step_tokens[i] for i in rows], lps, tops)
            self.num_generation_tokens += len(rows)
            for i, seq in zip(rows, seqs):
                ended = self._take(seq, step_tokens[i])
                if ended is not None:
                    outputs.append(ended)
                    alive.remove(i)
        return outputs + [self.trackers[decodes[i].request_id].make_output() for i in alive]

    def _take(self, seq: Sequence, token: int) -> RequestOutput | None:
        """seq's newest token through its grammar and output tracker: the
        request's last output if that ended it, else None."""
        tracker = self.trackers[seq.request_id]
        try:
            if seq.constraint is not None:
                seq.constraint.accept(token)
            reason = tracker.on_token(token)
            if reason is None and seq.constraint is not None and seq.constraint.is_terminated:
                reason = "stop"  # the grammar ended (its stop token, even with ignore_eos)
        except Exception as e:  # matching, detokenizing or stop matching broke on this request alone
            log.exception("output processing failed for request %s", seq.request_id)
            self.num_request_faults += 1
            return self._fail(seq.request_id, e)
        if reason is None:
            return None
        self._finish(seq, reason)
        del self.trackers[seq.request_id]
        return tracker.make_output()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent)."""
        if self.executor is not None:
            self.executor.shutdown()

    def _fail(self, request_id: str, error: BaseException) -> RequestOutput:
        """End a request because a step failed on it; its pages are freed, and
        the tokens it already produced stay as they were."""
        tracker = self.trackers.pop(request_id)
        self._finish(tracker.seq, "error")
        if isinstance(error, InvalidRequestError):  # the request's own fault, found while running it
            return tracker.make_output(error=str(error), error_code=error.code)
        return tracker.make_output(error=f"{type(error).__name__}: {error}")

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.runner.release(seq.request_id)
        if self.speculator is not None:
            self.speculator.release(seq.request_id)

    def prompt_logprobs(self, token_ids: list[int]) -> torch.Tensor:
        """log p(token i+1 | tokens <= i) of a scored text window, for
        perplexity: through the pages and the prefill kernel on scratch pages
        when enough are free, else an uncached pass (the same numbers)."""
        return self._on_scratch(token_ids, lambda pages: self.runner.prompt_logprobs(token_ids, pages))

    def prompt_token_logprobs(self, token_ids: list[int], top_k: int = 0
                              ) -> tuple[list[float], list[list[tuple[int, float]]] | None, list[int]]:
        """Each prompt token's logprob given the tokens before it (from the
        second on), with top_k the top_k most likely (token, logprob) pairs at
        each of those positions, and each token's rank there (1: the most
        likely): OpenAI's echo with logprobs, vLLM's prompt_logprobs."""
        return scored_token_logprobs(self.prompt_logits(token_ids), token_ids[1:], top_k)

    def prompt_logits(self, token_ids: list[int], rows: list[int] | None = None) -> torch.Tensor:
        """Next-token logits at rows (default: every position but the last) of
        one scored pass, as prompt_logprobs runs it (KL divergence, retrieval)."""
        return self._on_scratch(token_ids, lambda pages: self.runner.prompt_logits(token_ids, rows, pages))

    def _on_scratch(self, token_ids: list[int], fn):
        pages = self.block_manager.take_scratch(-(-len(token_ids) // self.block_manager.block_size))
        try:
            return fn(pages)
        finally:
            if pages is not None:
                self.block_manager.release_scratch(pages)

    def stats(self) -> dict:
        bm = self.block_manager
        return {
            **self._runner_stats,
            "model": self.model_name, "max_model_len": self.max_model_len,
            "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
            "num_free_blocks": bm.num_free_blocks, "kv_usage": bm.usage,
            "num_free_window_blocks": bm.window_pages.num_free if bm.window_pages is not None else None,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": bm.prefix_queries, "prefix_cache_hits": bm.prefix_hits,
            "prompt_tokens": self.num_prompt_tokens, "generation_tokens": self.num_generation_tokens,
            "request_faults": self.num_request_faults, "engine_faults": self.num_engine_faults,
            "last_engine_fault": self.last_engine_fault, "decode_bursts": self.num_bursts,
            **(self.speculator.stats() if self.speculator is not None else {}),
        }
