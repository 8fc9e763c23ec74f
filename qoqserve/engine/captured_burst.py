"""Decode bursts over captured steps (engine/burst.py says when one runs):
a row count's captured step, then (rows with penalties) their penalties
(kernels/cpu/burst_penalties.c, state in engine/burst_penalties.py), then
(rows that sample) each row's draw
(kernels/cpu/sample.c's sample_step), then (rows that want logprobs) each
row's logprobs (kernels/cpu/logprobs.c's logprob_step), then
decode_advance, which feeds each row's token back as its next input: one
plan replayed n times in one call. Tokens, and logprobs where asked, come
back from [steps, rows] buffers, each step's at its place.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from qoqserve.engine.burst_penalties import BurstPenaltyState, changes_logits
from qoqserve.engine.sequence import Sequence
from qoqserve.kernels.cpu import burst_penalties, decode_advance, graph
from qoqserve.kernels.cpu import logprobs as cpu_logprobs
from qoqserve.kernels.cpu import sample as cpu_sample


@dataclass
class BurstResult:
    tokens: list[list[int]]                                   # [steps][rows]
    logprobs: list[list[float]] | None = None                 # [steps][rows]: each chosen token's
    top: list[list[list[tuple[int, float]]]] | None = None    # [steps][rows][k]: the k most likely


class CapturedBursts:
    def __init__(self, decode, max_burst: int):
        """decode: the CapturedDecode whose graphs, heads and input buffers the bursts replay."""
        self.decode = decode
        self.max_burst = max(1, max_burst)
        rows = decode.max_size
        # per (row count, sampled, top k or None: no logprobs, penalized): the plan
        self.plans: dict[tuple[int, bool, int | None, bool], graph.StepGraph] = {}
        self._penalties: BurstPenaltyState | None = None  # made on the first penalized burst
        self._draws: dict[int, dict[str, torch.Tensor]] = {}  # a sampled burst's settings and uniforms
        self._logprobs: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # (rows, k): lp, top ids, top lps
        self._history = torch.zeros(self.max_burst * rows, dtype=torch.long)  # [steps, rows] of the tokens
        self._step = torch.zeros(1, dtype=torch.long)

    def clear(self) -> None:
        self.plans.clear()

    def run_sequences(self, decodes: list[Sequence], n: int, sampler) -> BurstResult | None:
        """run() with what these sequences ask for: the draws of the rows that
        sample (taken from `sampler` up front; given back when the burst does
        not run), logprobs, penalties."""
        asking = [s.params.top_logprobs for s in decodes if s.params.logprobs]
        top_k = max(asking) if asking else None
        penalized = any(changes_logits(s) for s in decodes)
        if all(s.params.greedy for s in decodes):
            return self.run(decodes, n, top_k=top_k, penalized=penalized)
        sampler.begin()
        try:
            out = self.run(decodes, n, lambda steps: sampler.burst_draws(decodes, steps), top_k, penalized)
        except Exception:
            sampler.rollback()
            raise
        if out is None:
            sampler.rollback()
        return out

    def run(self, decodes: list[Sequence], n: int, draw=None, top_k: int | None = None,
            penalized: bool = False) -> BurstResult | None:
        """n decode steps of these sequences, replayed back to back from C, or
        None when this batch cannot burst (not captured, no greedy token in the
        step, n past max_burst, no C sampler where rows sample, no C logprobs
        where they are asked for). Every sequence must have the slots of its
        next n - 1 positions. draw: None when every row is greedy, else draw(n)
        -> (temperatures, min_ps, top_ks, top_ps, uniforms [n][rows]), called
        once the burst can run. top_k: None, or each row's logprobs with its
        top_k most likely. penalized: some rows have penalties (never with
        logprobs: engine/burst_penalties.py)."""
        dec, b = self.decode, len(decodes)
        size = dec.bucket(b)
        g = dec._graph(size) if size is not None and 1 <= n <= self.max_burst else None
        head = dec._head(b) if g is not None else None
        if head is None or head.output[1] is None or not decode_advance.available():
            return None
        needs_f32 = draw is not None or top_k is not None or penalized
        if needs_f32 and head.output[0].dtype != torch.float32:
            return None
        if ((draw is not None and not cpu_sample.available()) or (top_k is not None and not cpu_logprobs.available())
                or (penalized and (top_k is not None or not burst_penalties.available()))):
            return None
        key = (b, draw is not None, top_k, penalized)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = self._plan(b, g, head, draw is not None, top_k, penalized)
        if penalized:
            self._penalties.write(decodes)
        if draw is not None:
            bufs = self._draws[b]
            *settings, uniforms = draw(n)
            for name, values in zip(("temperature", "min_p", "top_k", "top_p"), settings):
                bufs[name].copy_(torch.tensor(values, dtype=bufs[name].dtype))
            bufs["u"][:n] = torch.tensor(uniforms, dtype=torch.float64)
        dec._write_inputs(decodes)
        if size > b:
            dec._reset_rows(b, size)
        self._step[0] = 0
        start = time.perf_counter()
        plan.replay(n)
        dec.step_seconds[b] = (time.perf_counter() - start) / n
        out = BurstResult(self._history[:n * b].view(n, b).tolist())
        if top_k is not None:
            lp, ids, lps = self._logprobs[(b, top_k)]
            out.logprobs = lp[:n].tolist()
            if top_k:
                ids, lps = ids[:n].tolist(), lps[:n].tolist()
                out.top = [[list(zip(i, v)) for i, v in zip(step_ids, step_lps)]
                           for step_ids, step_lps in zip(ids, lps)]
        return out

    def _plan(self, b: int, g: graph.StepGraph, head: graph.StepGraph, sampled: bool,
              top_k: int | None, penalized: bool) -> graph.StepGraph:
        dec = self.decode
        plan, chosen = dec._step(b, g, head), head.output[1]
        history = self._history[:self.max_burst * b].view(self.max_burst, b)
        if penalized:
            if self._penalties is None:
                self._penalties = BurstPenaltyState(dec.max_size, head.output[0].shape[1],
                                                    dec.block_tables.shape[1] * dec.block_size)
            state = {k: v[:b] for k, v in self._penalties.bufs.items()}
            penalize = graph.StepGraph()
            penalize.capture(burst_penalties.penalize_step, head.output[0], head.output[1], state, history,
                             self._step)
            plan = plan.then(penalize)
        # buffers made once per row count (and k): every plan that records their
        # addresses must find them alive, the plans with and without logprobs alike
        if sampled:
            bufs = self._draws.setdefault(b, {
                "temperature": torch.zeros(b), "min_p": torch.zeros(b), "top_k": torch.zeros(b, dtype=torch.long),
                "top_p": torch.ones(b), "u": torch.zeros(self.max_burst, b, dtype=torch.float64),
                "chosen": torch.zeros(b, dtype=torch.long)})
            choose = graph.StepGraph()
            choose.capture(cpu_sample.sample_step, head.output[0], head.output[1], bufs["temperature"],
                           bufs["min_p"], bufs["top_k"], bufs["top_p"], bufs["u"], self._step, bufs["chosen"])
            plan, chosen = plan.then(choose), bufs["chosen"]
        if top_k is not None:
            bufs = self._logprobs.setdefault((b, top_k), (
                torch.zeros(self.max_burst, b), torch.zeros(self.max_burst, b, top_k, dtype=torch.long),
                torch.zeros(self.max_burst, b, top_k)))
            record = graph.StepGraph()
            record.capture(cpu_logprobs.logprob_step, head.output[0], chosen, self._step, top_k, *bufs)
            plan = plan.then(record)
        advance = graph.StepGraph()
        advance.capture(decode_advance.advance, chosen, dec.ids, dec.positions, dec.context_lens,
                        dec.slots, dec.block_tables, dec.block_size, dec.pad_slot, history, self._step)
        return plan.then(advance)
