"""Turns sampled tokens into request outputs: detokenization, stop conditions."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from qoqserve.engine.sequence import Sequence
from qoqserve.model_loader.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]          # all output tokens so far
    text: str                     # all output text released so far
    delta_text: str               # text released by this step
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None      # finish_reason "error": what failed
    error_code: str | None = None  # set when it was the request's own fault (InvalidRequestError.code)


class OutputTracker:
    """Per-request text state. Text that could still turn into the start of a
    stop string is held back, so a stream never shows what a stop would cut."""

    def __init__(self, seq: Sequence, tokenizer: Tokenizer, eos_ids: set[int], max_model_len: int):
        self.seq = seq
        params = seq.params
        # one list for every output of the request: copying the prompt per step
        # cost O(prompt) per request and step
        self.prompt_ids = seq.token_ids[:seq.num_prompt_tokens]
        self.detok = IncrementalDetokenizer(tokenizer, self.prompt_ids, skip_special_tokens=params.skip_special_tokens)
        self.text = ""
        self.released = 0
        self.stop_token_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids)
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.max_model_len = max_model_len
        self.pending: list[int] = []

    def on_token(self, token: int) -> str | None:
        """Account for the newest token; returns a finish reason or None."""
        seq, params = self.seq, self.seq.params
        self.pending.append(token)
        can_stop = seq.num_output_tokens >= params.min_tokens
        if token in self.stop_token_ids and can_stop:
            return self._flush("stop")
        before = len(self.text)
        self.text += self.detok.add(token)
        if params.stop and can_stop:
            cut = self._find_stop(max(0, before - self.hold))
            if cut is not None:
                self.text = self.text[:cut]
                return "stop"
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return self._flush("length")
        if len(seq) >= self.max_model_len:
            return self._flush("length")
        return None

    def _flush(self, reason: str) -> str:
        # the detokenizer may hold the start of a multi-byte character back
        self.text += self.detok.flush()
        return reason

    def _find_stop(self, start: int) -> int | None:
        best = None
        for s in self.seq.params.stop:
            i = self.text.find(s, start)
            if i >= 0:
                end = i + len(s) if self.seq.params.include_stop_str_in_output else i
                best = end if best is None else min(best, end)
        return best

    def make_output(self, error: str | None = None, error_code: str | None = None) -> RequestOutput:
        seq = self.seq
        finished = seq.is_finished
        limit = len(self.text) if finished else max(self.released, len(self.text) - self.hold)
        if error is not None:
            # held-back text might have been cut by a stop string the request never got to
            limit = self.released
        delta = self.text[self.released:limit]
        self.released = limit
        new_tokens, self.pending = self.pending, []
        metrics = {"arrival_time": seq.arrival_time}
        if seq.scheduled_time is not None:
            metrics["scheduled_time"] = seq.scheduled_time
        if seq.first_token_time is not None:
            metrics["first_token_time"] = seq.first_token_time
        if finished:
            metrics["finished_time"] = time.monotonic()
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=self.prompt_ids,
            token_ids=seq.output_token_ids, text=self.text[:limit], delta_text=delta,
            delta_token_ids=new_tokens, finished=finished, finish_reason=seq.finish_reason,
            logprobs=list(seq.logprobs) if seq.params.logprobs else None,
            top_logprobs=list(seq.top_logprobs) if seq.params.top_logprobs else None,
            num_cached_tokens=seq.num_cached_tokens, metrics=metrics, error=error, error_code=error_code)
