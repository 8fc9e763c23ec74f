"""FCFS scheduler with a per-step token budget and recompute preemption.

Each step is either a prefill step (new prompts, whole) or a decode step (one
token for every running sequence). When the page pool cannot give a running
sequence its next slot, the most recently admitted sequence is preempted: its
pages are freed and it goes back to the front of the queue, to be recomputed
(largely from the prefix cache) when room returns.
"""
from __future__ import annotations

from collections import deque

from qoqserve.config import SchedulerConfig
from qoqserve.engine.block_manager import BlockManager
from qoqserve.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int):
        self.max_num_seqs = config.max_num_seqs
        # A prompt is prefilled in one piece, so the budget must admit the longest one.
        self.max_num_batched_tokens = max(config.max_num_batched_tokens, max_model_len)
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        scheduled: list[Sequence] = []
        num_tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if num_tokens + len(seq) > self.max_num_batched_tokens and scheduled:
                break
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            num_tokens += len(seq) - seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(seq)
        if scheduled:
            return scheduled, True

        kept: deque[Sequence] = deque()
        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.block_manager.may_append(seq)
                scheduled.append(seq)
                kept.append(seq)
        self.running = kept
        return scheduled, False

    def postprocess(self, seq: Sequence, token: int, logprob: float | None,
                    top: list[tuple[int, float]] | None) -> None:
        """A step produced seq's next token: record it, and let the block
        manager register the page it may have completed in the prefix cache."""
        seq.append(token, logprob, top)
        self.block_manager.on_token_computed(seq)

    def _preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.block_manager.deallocate(seq)
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
