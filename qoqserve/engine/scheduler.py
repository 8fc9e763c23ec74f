"""FCFS (or priority) scheduler with a per-step token budget, chunked prefill
and recompute preemption.

Each step spends a token budget (max_num_batched_tokens), as vLLM does by
default: first one token for every running sequence that is decoding, then
the rest on prompts, in chunks: running sequences whose prefill is not done
continue, then waiting ones are admitted while pages and the budget last. A
prompt longer than the budget is prefilled over several steps, and
long_prefill_token_threshold caps what one prompt takes per step, so one huge
prompt cannot stall everyone. Decodes and prefill chunks share a step (a
mixed batch); a sequence samples only in the step that computes its last
token.

When the page pool cannot give a decoding sequence its next slot, the most
recently admitted sequence is preempted: its pages are freed and it goes back
to the front of the queue, to be recomputed (largely from the prefix cache)
when room returns. So is it when every running prompt waits for pages of the
sliding layers' own pool (engine/window_pages.py) that the others hold.

With the priority policy (vLLM's `--scheduling-policy priority`) the queue is
kept in order of (priority, arrival), lower first, a preempted sequence goes
back to its place in it, and the running sequence preempted is the one last
in that order.
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from qoqserve.config import SchedulerConfig
from qoqserve.engine.block_manager import BlockManager
from qoqserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    decodes: list[Sequence] = field(default_factory=list)
    # (sequence, tokens to compute this step), in batch order after the decodes
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)

    @property
    def sampled(self) -> list[Sequence]:
        """The sequences that get a token this step: decodes, and prefills whose
        chunk reaches their last token."""
        return self.decodes + [s for s, n in self.prefills if s.num_computed_tokens + n == len(s)]

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)

    @property
    def request_ids(self) -> list[str]:
        return [s.request_id for s in self.decodes] + [s.request_id for s, _ in self.prefills]

    def only(self, request_ids: set[str]) -> ScheduledBatch:
        """The part of this batch that belongs to request_ids, in the same order
        and with the same chunks (re-running it recomputes exactly those rows)."""
        return ScheduledBatch([s for s in self.decodes if s.request_id in request_ids],
                              [(s, n) for s, n in self.prefills if s.request_id in request_ids])


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        self.long_prefill_token_threshold = config.long_prefill_token_threshold or None
        self.block_manager = block_manager
        if config.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {config.scheduling_policy!r}")
        self.by_priority = config.scheduling_policy == "priority"
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    @staticmethod
    def _rank(seq: Sequence) -> tuple[int, float]:
        return seq.priority, seq.arrival_time

    def add(self, seq: Sequence) -> None:
        if self.by_priority:
            self.waiting.insert(bisect.bisect_right(self.waiting, self._rank(seq), key=self._rank), seq)
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """The prompt tokens of seq this step computes (taking the pages its
        sliding layers need for them, where they have a pool of their own)."""
        n = min(len(seq) - seq.num_computed_tokens, budget)
        if self.long_prefill_token_threshold:
            n = min(n, self.long_prefill_token_threshold)
        return self.block_manager.fit_chunk(seq, n)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        # 1. one token for every decoding sequence, preempting the newest (or the
        # last in priority order, served last) when full
        queue = deque(sorted(self.running, key=self._rank)) if self.by_priority else self.running
        kept: deque[Sequence] = deque()
        self.running = kept
        while queue:
            seq = queue.popleft()
            if seq.is_prefilling or budget == 0:
                kept.append(seq)
                continue
            while not bm.can_append(seq):
                # the last of the queue: the newest admitted, or the last in priority order
                self._preempt(queue.pop() if queue else seq)
                if seq.status != SequenceStatus.RUNNING:
                    break
            else:
                bm.may_append(seq)
                batch.decodes.append(seq)
                kept.append(seq)
                budget -= 1
        # 2. prompts already being prefilled go on
        for seq in kept:
            if seq.is_prefilling and budget > 0:
                n = self._chunk(seq, budget)
                if n:
                    batch.prefills.append((seq, n))
                    budget -= n
        # 3. new prompts while pages and budget last (all their pages up front)
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if not bm.can_allocate(seq):
                break
            bm.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.scheduled_time is None:
                seq.scheduled_time = time.monotonic()
            self.waiting.popleft()
            self.running.append(seq)
            n = self._chunk(seq, budget)  # 0: the sliding layers' pool is short; it goes on later
            if n:
                batch.prefills.append((seq, n))
                budget -= n
        if not batch and len(self.running) > 1:
            # every running prompt waits for the sliding layers' pages the
            # others hold: the newest (or last in priority order) gives them back
            victim = max(self.running, key=self._rank) if self.by_priority else self.running[-1]
            self.running.remove(victim)
            self._preempt(victim)
            return self.schedule()
        return batch

    def postprocess(self, batch: ScheduledBatch, tokens: list[int], logprobs: list[float] | None,
                    top: list[list[tuple[int, float]]] | None) -> list[Sequence]:
        """A step ran: advance what each sequence has computed, register the pages it
        completed in the prefix cache, and record the tokens sampled (in the order of
        batch.sampled, which is returned)."""
        sampled = batch.sampled
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
        for seq, n in batch.prefills:
            seq.num_computed_tokens += n
        for i, seq in enumerate(sampled):
            seq.append(tokens[i], logprobs[i] if logprobs is not None else None,
                       top[i] if top is not None else None)
        for seq in batch.decodes + [s for s, _ in batch.prefills]:
            self.block_manager.on_tokens_computed(seq)
        return sampled

    def _preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.block_manager.deallocate(seq)
        if self.by_priority:
            self.add(seq)
        else:
            self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark seq finished and release its pages (from any queue)."""
        if seq.status == SequenceStatus.FINISHED:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.deallocate(seq)
