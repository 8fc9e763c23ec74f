"""Token sampling: constraint masks, penalties and banned tokens
(layers/token_bans.py), then greedy or a draw (temperature, min_p, top-k,
top-p: layers/token_draw.py); per-request seeds.

Each sampled row draws one uniform from its own generator when seeded, so a
seeded request draws the same tokens whatever else shares its batch. A constrained
request's disallowed tokens are -inf before anything else (layers/token_mask.py),
so every sampling mode, and the logprobs, see only what the grammar allows.
"""
from __future__ import annotations

from typing import Protocol

import torch

from qoqserve.errors import BannedEverythingError, ConstraintDeadEndError
from qoqserve.kernels.cpu import elementwise
from qoqserve.kernels.cpu import sample as cpu_sample
from qoqserve.layers.token_bans import BanningRequest, TokenBans
from qoqserve.layers.token_draw import draw_settings, draw_tokens
from qoqserve.layers.token_logprobs import StepLogprobs
from qoqserve.layers.token_mask import ConstraintMasks, TokenConstraint
from qoqserve.sampling_params import SamplingParams


class SamplingRequest(BanningRequest, Protocol):
    """What the sampler reads of a request (engine.Sequence has it)."""
    request_id: str
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    output_counts: dict[int, int]
    constraint: TokenConstraint | None  # the tokens a grammar allows next, or None

    @property
    def takes_argmax(self) -> bool:
        """Its token is the argmax of its logits, nothing else of them wanted."""


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_counts: dict[int, int]) -> torch.Tensor:
    """Repetition (HF/CTRL style, prompt + output), OpenAI presence/frequency
    (output) and logit_bias (added last, as OpenAI's)."""
    logits = logits.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_counts)), dtype=torch.long,
                            device=logits.device)
        vals = logits[seen]
        p = params.repetition_penalty
        # a masked token stays -inf: a tiny p (5e-324, found by schemathesis) is 0 in fp32,
        # and -inf * 0 is NaN, which argmax would pick
        logits[seen] = torch.where(vals > 0, vals / p, torch.where(torch.isneginf(vals), vals, vals * p))
    if output_counts and (params.presence_penalty or params.frequency_penalty):
        ids = torch.tensor(list(output_counts), dtype=torch.long, device=logits.device)
        counts = torch.tensor(list(output_counts.values()), dtype=logits.dtype, device=logits.device)
        logits[ids] -= params.frequency_penalty * counts + params.presence_penalty
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=logits.device)
        logits[ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=logits.device)
    return logits


class RequestAhead:
    """A request as it would stand with tokens appended that are not yet its
    (drafts being verified): what the sampler reads of it, for one with no
    grammar and no banned tokens."""
    constraint = None
    bad_words_ids = ()
    active_stop_bans = ()
    bans_tokens = False

    def __init__(self, req: SamplingRequest, tokens: list[int]):
        self.request_id, self.params, self.num_prompt_tokens = req.request_id, req.params, req.num_prompt_tokens
        self.token_ids = req.token_ids + tokens
        self.output_counts = dict(req.output_counts)
        for t in tokens:
            self.output_counts[t] = self.output_counts.get(t, 0) + 1
        self.takes_argmax = req.takes_argmax


def argmax_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Greedy tokens of fp32 logits [B, V]: the C kernel's on CPU (torch's index, faster)."""
    if elementwise.argmax_takes(logits):
        return elementwise.argmax(logits)
    return logits.argmax(dim=-1)


class Sampler:
    """Owns the sampling state: the engine-wide generator, and one generator
    per seeded request (made on its first token, kept across preemptions, and
    dropped by release() when the request ends).

    A step that fails after drawing must not move a seeded request's stream:
    the engine re-runs the step (or part of it) to find the culprit, and the
    others must then draw exactly what they would have. begin() starts a log
    of the seeded generators each call touches (a ~1 us state copy per seeded
    row) and rollback() restores them. The engine-wide generator of unseeded
    rows is not rolled back: their draws depend on the batch anyway.

    Everything but the draws' uniforms runs on the logits' device; only the
    chosen ids and the requested logprobs come back to the host (a few bytes
    per row, not the [B, vocab] logits), so a CUDA step does not copy its
    logits out. The generators are CPU ones: a sampled row takes one number
    a step from them."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)  # the engine-wide one: unseeded requests
        self._generators: dict[str, torch.Generator] = {}
        self._undo: list[tuple[str, torch.Tensor | None]] = []
        self.masks = ConstraintMasks()
        self.bans = TokenBans()

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self.bans.release(request_id)

    def begin(self) -> None:
        """A new step: forget the previous one's undo log."""
        self._undo.clear()

    def rollback(self) -> None:
        """Put every seeded generator drawn from since begin() back as it was."""
        for rid, state in reversed(self._undo):
            if state is None:
                self._generators.pop(rid, None)
            elif rid in self._generators:
                self._generators[rid].set_state(state)
        self._undo.clear()

    def _generator(self, req: SamplingRequest) -> torch.Generator:
        if req.params.seed is None:
            return self.generator
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator().manual_seed(req.params.seed)
            self._generators[req.request_id] = gen
            self._undo.append((req.request_id, None))
        else:
            self._undo.append((req.request_id, gen.get_state()))
        return gen

    def uniforms(self, req: SamplingRequest, n: int) -> list[float]:
        """The request's next n uniforms in [0, 1): one a sampled token, whether
        its steps run one by one or in a decode burst (the same draws either way).
        From CPU generators whatever the logits' device: a number a row, no
        device round trip each."""
        gen = self._generator(req)
        return [float(torch.rand((), dtype=torch.float64, generator=gen)) for _ in range(n)]

    def after_drafts(self, logits: torch.Tensor, req: SamplingRequest, first: int, drafts: list[int]
                     ) -> list[tuple[int, float | None, list[tuple[int, float]] | None]]:
        """A request's tokens after its drafts (logits [k, V]: row j the logits
        after drafts[j]), each chosen as a plain step there would choose it
        (penalties counting the drafts before it), with its logprob and top
        pairs where the request asks (else None), while the token before each
        equals its draft: the first token after a draft that is not taken ends
        them. A drawn token takes one uniform, so a request's uniforms are those
        of plain steps. For requests with no grammar or banned tokens."""
        out, last = [], first
        for j, draft in enumerate(drafts):
            if last != draft:
                break
            tokens, chosen, top = self(logits[j:j + 1], [RequestAhead(req, drafts[:j + 1])])
            last = tokens[0]
            out.append((last, chosen[0] if chosen else None, (top[0] if top else None) or ([] if chosen else None)))
        return out

    def burst_draws(self, requests: list[SamplingRequest], steps: int) -> tuple[list, list, list, list, list]:
        """What a decode burst's sample_step reads for these rows: (temperatures,
        min_ps, top_ks, top_ps, uniforms [steps][rows]; greedy rows: temperature 0, u unused)."""
        ps = [r.params for r in requests]
        u = [self.uniforms(r, steps) if not p.greedy else [0.0] * steps for r, p in zip(requests, ps)]
        return (*draw_settings(ps), [list(step) for step in zip(*u)])

    @staticmethod
    def _penalize(logits: torch.Tensor, rows: list[int], requests: list[SamplingRequest]) -> None:
        """apply_penalties on those rows, in place: in one C call on CPU (the
        same bits), else row by row."""
        if logits.device.type != "cpu" or logits.stride(1) != 1 or not cpu_sample.available():
            for i, r in zip(rows, requests):
                logits[i] = apply_penalties(logits[i], r.params, r.token_ids[:r.num_prompt_tokens], r.output_counts)
            return
        ps = [r.params for r in requests]
        cpu_sample.penalize_rows(
            logits, rows, [r.token_ids if p.repetition_penalty != 1.0 else [] for r, p in zip(requests, ps)],
            [r.output_counts if p.presence_penalty or p.frequency_penalty else {} for r, p in zip(requests, ps)],
            [p.logit_bias for p in ps], [p.repetition_penalty for p in ps], [p.presence_penalty for p in ps],
            [p.frequency_penalty for p in ps])

    def __call__(self, logits: torch.Tensor, requests: list[SamplingRequest], greedy: torch.Tensor | None = None
                 ) -> tuple[list[int], list[float] | None, list[list[tuple[int, float]]] | None]:
        """logits [B, V] -> chosen token per row; when any row asks, each chosen token's
        logprob and each row's top_logprobs most likely (token, logprob) pairs.
        Logprobs are of the model's distribution (within what a constraint allows),
        before penalties, banned tokens and temperature. fp32 logits are modified in
        place (constrained rows masked, penalized rows penalized): every step, and
        every re-run of a failed one, computes them anew.
        greedy: each row's argmax of these logits, computed already (the
        captured step's); not used once a constraint has masked a row."""
        params = [r.params for r in requests]
        constraints = [r.constraint for r in requests]
        if greedy is not None and all(r.takes_argmax for r in requests):
            return greedy.tolist(), None, None  # the step's argmax is every row's token: nothing else to do
        banning = [i for i, r in enumerate(requests) if r.bans_tokens]
        logits = logits.float()
        dead = self.masks.apply(logits, constraints)
        if dead:  # nothing to sample from: those requests end (engine/isolation.py), the rest go on
            raise ConstraintDeadEndError([requests[i].request_id for i in dead])
        penalized = [i for i, p in enumerate(params) if p.has_penalties]
        changed = sorted(set(penalized) | set(banning))  # rows whose logits change in place below
        asking = [i for i, p in enumerate(params) if p.logprobs]
        logprobs = StepLogprobs(logits, asking, [params[i].top_logprobs for i in asking],
                                set(changed)) if asking else None
        # greedy rows without penalties: one argmax for the batch
        masked = any(c is not None for c in constraints)
        tokens = greedy.clone() if greedy is not None and not masked else argmax_tokens(logits)
        if penalized:
            self._penalize(logits, penalized, [requests[i] for i in penalized])
        if banning:
            dead = self.bans.apply(logits, banning, [requests[i] for i in banning])
            if dead:
                raise BannedEverythingError([requests[i].request_id for i in dead])
        rows = [i for i in changed if params[i].greedy]
        if rows:
            tokens[rows] = argmax_tokens(logits if len(rows) == len(params) else logits[rows])
        drawn = [i for i, p in enumerate(params) if not p.greedy]
        if drawn:
            u = [self.uniforms(requests[i], 1)[0] for i in drawn]
            tokens[drawn] = torch.tensor(draw_tokens(logits, drawn, [params[i] for i in drawn], u),
                                         device=tokens.device)
        chosen, top = logprobs.results(tokens, len(params)) if logprobs is not None else (None, None)
        return tokens.tolist(), chosen, top
