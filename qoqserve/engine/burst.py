"""Decode bursts: several decode steps run back to back from C, with
no Python between them (what vLLM called multi-step scheduling,
`--num-scheduler-steps`).

A captured decode step at batch 1 replays in ~1.5-2 ms on this CPU, and the
Python around it (scheduling, the sampler, detokenizing, stop checks, the
outputs) adds ~0.1 ms, most of it cache misses after the step's weight
stream has been through the caches (docs/runtime.md). When every running
sequence's token is the step's own argmax or a plain draw (temperature,
min_p, top_k, top_p: kernels/cpu/sample.c's sample_step, recorded after the
LM head, with uniforms taken from each row's generator up front, one a step
as single steps take them), the step can feed it back as the next input
itself (kernels/cpu/decode_advance.c) and run again: n steps cost one round
of that Python, and the n tokens then go through the same per-token output
path, one step after the other, as n single steps would have. The tokens are
the same: every step is the same replayed calls on the same inputs and the
same uniforms (a burst that does not run gives its uniforms back).

A burst runs only when it cannot change what a request gets:
- nothing waits to be admitted and no prompt is being prefilled (a burst
  delays the next scheduling decision by its length);
- every sequence is greedy or plainly sampled, with its penalties and its
  stop tokens banned until min_tokens (engine/burst_penalties.py) or its
  logprobs (not both), unconstrained, and bans no other token
  (allowed_token_ids, bad_words);
- no sequence can reach max_tokens or the context window inside it; one
  that stops (EOS, a stop token or string) inside it ends at that token, and
  what the burst computed for it after that is dropped;
- the pool has the pages of every sequence's next positions up front.
It is capped at a time budget of steps (`LLMEngine.burst_seconds`, by the
last captured step's time at this row count): BURST_SECONDS by default, so
streamed tokens arrive at least ~60 times a second and a request arriving
during a burst waits at most that long (at 32 streams a step takes ~13 ms
here, so large batches run single steps); OFFLINE_BURST_SECONDS for the
offline `LLM` API, whose caller waits for whole requests.
"""
from __future__ import annotations

from qoqserve.engine import burst_penalties
from qoqserve.engine.scheduler import ScheduledBatch

BURST_SECONDS = 0.016
OFFLINE_BURST_SECONDS = 0.25


def burst_length(batch: ScheduledBatch, waiting: bool, max_steps: int, max_model_len: int,
                 step_seconds: float | None, budget_seconds: float = BURST_SECONDS) -> int:
    """How many decode steps this batch may run at once (1: a single step)."""
    if max_steps < 2 or waiting or batch.prefills or not batch.decodes or not step_seconds:
        return 1
    n = min(max_steps, int(budget_seconds / step_seconds))
    for seq in batch.decodes:
        if not seq.params.burstable or seq.constraint is not None or not burst_penalties.takes(seq):
            return 1
        n = min(n, max_model_len - len(seq))  # the step's token makes len(seq) + 1
        if seq.params.max_tokens is not None:
            n = min(n, seq.params.max_tokens - seq.num_output_tokens)
    return max(n, 1)
