"""A decode burst's penalty state (kernels/cpu/burst_penalties.c applies it
each step): for each penalized row what single steps read from its Sequence
(sampler.apply_penalties): the repetition, presence and frequency
penalties, the tokens it has seen (prompt and output) as a bitmap, its
output tokens with their counts, its logit bias; and the stop tokens banned
until min_tokens are out (layers/token_bans.py), with how many more steps.
Written before each burst; the kernel brings it up to date step by step.
One set of buffers for the largest row count (a burst of b rows uses the
first b), made on the first penalized burst: every plan records their
addresses.
"""
from __future__ import annotations

import numpy as np
import torch

from qoqserve.engine.sequence import Sequence

BIAS_CAP = 512  # logit_bias entries a row may have and still burst
STOP_CAP = 64   # stop tokens banned until min_tokens (its stop_token_ids and EOS)


def changes_logits(seq: Sequence) -> bool:
    """The burst must change its logits: penalties, or stop tokens banned
    until min_tokens are out."""
    return seq.params.has_penalties or bool(seq.active_stop_bans)


def takes(seq: Sequence) -> bool:
    """What it changes fits the state (and no logprobs with it: those are of
    the logits before, which the burst overwrites)."""
    p = seq.params
    return not changes_logits(seq) or (not p.logprobs and len(p.logit_bias or ()) <= BIAS_CAP
                                       and len(seq.stop_bans) <= STOP_CAP)


class BurstPenaltyState:
    def __init__(self, rows: int, vocab: int, max_len: int):
        words = -(-vocab // 32)
        self.bufs = {
            "on": torch.zeros(rows, dtype=torch.int32), "temperature": torch.zeros(rows),
            "rep": torch.ones(rows), "presence": torch.zeros(rows), "frequency": torch.zeros(rows),
            "seen": torch.zeros(rows, words, dtype=torch.int32),
            "out_tok": torch.zeros(rows, max_len, dtype=torch.long), "out_cnt": torch.zeros(rows, max_len),
            "out_len": torch.zeros(rows, dtype=torch.long),
            "bias_tok": torch.zeros(rows, BIAS_CAP, dtype=torch.long), "bias_val": torch.zeros(rows, BIAS_CAP),
            "bias_len": torch.zeros(rows, dtype=torch.long),
            "stop_tok": torch.zeros(rows, STOP_CAP, dtype=torch.long), "stop_len": torch.zeros(rows, dtype=torch.long),
            "ban_steps": torch.zeros(rows, dtype=torch.long)}
        self._np = {k: v.numpy() for k, v in self.bufs.items()}
        self._seen_bits = self._np["seen"].view(np.uint32)

    def write(self, decodes: list[Sequence]) -> None:
        n = self._np
        for i, seq in enumerate(decodes):
            p = seq.params
            n["on"][i] = changes_logits(seq)
            if not n["on"][i]:
                continue
            bans = seq.active_stop_bans
            n["stop_len"][i], n["ban_steps"][i] = len(bans), p.min_tokens - seq.num_output_tokens
            n["stop_tok"][i, :len(bans)] = bans
            n["temperature"][i], n["rep"][i] = p.temperature, p.repetition_penalty
            n["presence"][i], n["frequency"][i] = p.presence_penalty, p.frequency_penalty
            if p.repetition_penalty != 1.0:
                seen, ids = self._seen_bits[i], np.asarray(seq.token_ids, dtype=np.int64)
                seen[:] = 0
                np.bitwise_or.at(seen, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
            counts = seq.output_counts
            n["out_len"][i] = len(counts)
            n["out_tok"][i, :len(counts)] = list(counts)
            n["out_cnt"][i, :len(counts)] = list(counts.values())
            bias = p.logit_bias or {}
            n["bias_len"][i] = len(bias)
            n["bias_tok"][i, :len(bias)] = list(bias)
            n["bias_val"][i, :len(bias)] = list(bias.values())
