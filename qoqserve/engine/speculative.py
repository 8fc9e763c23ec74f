"""Speculative decoding with draft tokens looked up in each request's own
context (vLLM's "ngram" method: engine/ngram_proposer.py), verified by the
model in one step.

A request whose token is chosen from the logits, its sampling params and
its own tokens alone (greedy or drawn, penalties and logprobs included; no
grammar or banned tokens: Sequence.verifies_drafts) may get up to
num_speculative_tokens drafts d1..dk in a step. The step then runs 1 + k rows for it: its newest token,
as any decode, and each draft at its position; every row writes its K/V and
attends to the sequence up to its own position, exactly as the one-token
step at that position would (the decode kernels compute each row alone:
ModelRunner.run_verify). The step's token t0 is taken as always; d1 is
accepted when it equals t0, and then the token after d1 is the next one, and
so on: the request gets 1 + (drafts accepted) tokens, each the one plain
decoding gives, bit for bit. A plain greedy row's token after a draft is
its argmax; any other's is chosen by the sampler, as a plain step there
would choose it (its penalties counting the drafts before it; its
logprobs those of that row), and only once those drafts are accepted, so a drawn request takes one uniform a
token and a seeded one draws what it draws without drafts (for an n-gram
draft, a point mass, accepting d with probability p(d) and otherwise
drawing from p without d is what rejection sampling does). What the step wrote for
rejected drafts lies past the sequence's computed tokens and is overwritten
before anything reads it; the prefix cache registers only pages whose
tokens are all computed.

Drafts are proposed only in steps that are all decodes (a step with prompt
chunks runs as before), within the captured step sizes (so the step stays a
replayed graph), for the pages the pool has, and never past max_tokens or
the context window. A step without any draft runs as before, bursts
included.
"""
from __future__ import annotations

from qoqserve.config import SpeculativeConfig
from qoqserve.engine.block_manager import BlockManager
from qoqserve.engine.ngram_proposer import NgramIndex
from qoqserve.engine.scheduler import ScheduledBatch
from qoqserve.engine.sequence import Sequence

# A request whose recent drafts were mostly rejected stops drafting for a
# while: each rejected draft cost a row of the step, and a step with drafts
# runs alone, not in a burst. Its acceptance rate (a running mean over its
# speculative steps) starts at 1; while it is below MIN_RATE the request
# runs plain steps, the rate creeping back by RECOVER a step until it drafts
# again (docs/benchmarks.md: the measurements behind both).
MIN_RATE, RECOVER = 0.5, 0.05


class Drafting:
    """One request's drafting state: its n-gram index and acceptance rate."""

    def __init__(self, n_min: int, n_max: int):
        self.index = NgramIndex(n_min, n_max)
        self.rate = 1.0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        if self.rate < MIN_RATE:
            self.rate = min(1.0, self.rate + RECOVER)
            return []
        return self.index.propose(tokens, k)

    def verified(self, drafted: int, accepted: int) -> None:
        self.rate = 0.5 * self.rate + 0.5 * accepted / drafted


class Speculator:
    def __init__(self, config: SpeculativeConfig, block_manager: BlockManager, max_model_len: int,
                 max_rows: int):
        """max_rows: the most rows a step may have (the largest captured size)."""
        self.config, self.block_manager = config, block_manager
        self.max_model_len, self.max_rows = max_model_len, max_rows
        self._drafting: dict[str, Drafting] = {}
        self.num_drafts = 0           # (request, step) pairs with drafts verified
        self.num_draft_tokens = 0     # drafts verified
        self.num_accepted_tokens = 0  # of those, accepted

    def release(self, request_id: str) -> None:
        self._drafting.pop(request_id, None)

    def _room(self, seq: Sequence) -> int:
        k = min(self.config.num_speculative_tokens, self.max_model_len - len(seq) - 1)
        if seq.params.max_tokens is not None:
            k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
        return k

    def drafts(self, batch: ScheduledBatch) -> list[list[int]] | None:
        """Each decode's drafts for this step ([] for none), their pages
        reserved; None when no decode has any."""
        if batch.prefills or not batch.decodes:
            return None
        rows_left = self.max_rows - len(batch.decodes)
        out: list[list[int]] = []
        for seq in batch.decodes:
            d: list[int] = []
            k = min(rows_left, self._room(seq))
            # drafts verified by its own choice give it what it would get anyway
            if k > 0 and seq.verifies_drafts:
                state = self._drafting.get(seq.request_id)
                if state is None:
                    state = self._drafting[seq.request_id] = Drafting(self.config.prompt_lookup_min,
                                                                      self.config.prompt_lookup_max)
                d = state.propose(seq.token_ids, k)
                if d and not self.block_manager.reserve([seq], len(d)):
                    d = []
            rows_left -= len(d)
            out.append(d)
        return out if any(out) else None

    def accept(self, decodes: list[Sequence], first: list[int], drafts: list[list[int]],
               after: list[list[int]]) -> list[list[int]]:
        """Each decode's tokens of the step: its sampled token, then, while the
        previous token equals the next draft, the token after that draft
        (after[i][j]: run_verify's, given as far as the drafts before held)."""
        out = []
        for seq, t0, d, a in zip(decodes, first, drafts, after):
            tokens = [t0]
            for j, draft in enumerate(d):
                if tokens[-1] != draft:
                    break
                tokens.append(a[j])
            if d:
                self._drafting[seq.request_id].verified(len(d), len(tokens) - 1)
                self.num_drafts += 1
            self.num_draft_tokens += len(d)
            self.num_accepted_tokens += len(tokens) - 1
            out.append(tokens)
        return out

    def stats(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens}


def per_step(first: list | None, after: list[list[tuple]], steps: int, k: int) -> list[list] | None:
    """Each decode's logprob (k 1) or top pairs (k 2), step by step, for the
    steps a verified step gives: the first as the sampler gave them, step s
    from the row after draft s - 1 (ModelRunner.run_verify's (token, logprob,
    top) after each draft; None past a decode's own tokens)."""
    if first is None:
        return None
    return [first] + [[a[s - 1][k] if s <= len(a) else None for a in after] for s in range(1, steps)]
