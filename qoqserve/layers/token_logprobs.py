"""The logprobs a step returns: for each row that asks, its chosen token's
and its top_logprobs most likely tokens', of the model's distribution (within
what a constraint allows), so taken before penalties, banned tokens and
temperature change the logits.

On CPU, kernels/cpu/logprobs.c gives each asking row's max, log-sum and k
most likely tokens in two passes over it; a logprob is then (l - max) -
logsum, as torch.log_softmax computes it, without a [B, V] log_softmax and a
topk over it. Elsewhere (CUDA) torch's, over the asking rows only.
"""
from __future__ import annotations

import torch

from qoqserve.kernels.cpu import logprobs as cpu_logprobs


class StepLogprobs:
    """Taken from fp32 logits [B, V] before the sampler changes any of their
    rows in place; `changing`: the rows it will change (theirs are kept)."""

    def __init__(self, logits: torch.Tensor, rows: list[int], top: list[int], changing: set[int]):
        self.rows, self.top = rows, top
        k = max(top)
        self.on_cpu = cpu_logprobs.takes(logits) and k <= cpu_logprobs.MAX_K
        if self.on_cpu:
            self.shift, self.logsum, ids, lps = cpu_logprobs.logprob_rows(logits, rows, k)
            self.kept = {i: logits[i].clone() for i in rows if i in changing}
            self.logits = logits
        else:
            self.lp = torch.log_softmax(logits[rows], dim=-1)
            lps, ids = self.lp.topk(k, dim=-1) if k else (None, None)
        self.top_ids = ids.tolist() if k else None
        self.top_lps = lps.tolist() if k else None

    def results(self, tokens: torch.Tensor, batch: int
                ) -> tuple[list[float | None], list[list[tuple[int, float]] | None] | None]:
        """(each row's chosen logprob, each row's top pairs: None for the
        rows that did not ask; the second None when no row wants top ones)."""
        chosen_ids = tokens[self.rows].to(torch.long)
        if self.on_cpu:
            raw = self.logits[torch.tensor(self.rows), chosen_ids]
            for j, i in enumerate(self.rows):
                if i in self.kept:
                    raw[j] = self.kept[i][chosen_ids[j]]
            values = ((raw - self.shift) - self.logsum).tolist()
        else:
            values = self.lp.gather(1, chosen_ids.to(self.lp.device)[:, None])[:, 0].tolist()
        chosen: list[float | None] = [None] * batch
        top = [None] * batch if self.top_ids is not None else None
        for j, i in enumerate(self.rows):
            chosen[i] = values[j]
            if top is not None:
                top[i] = list(zip(self.top_ids[j][:self.top[j]], self.top_lps[j][:self.top[j]]))
        return chosen, top


def scored_token_logprobs(logits: torch.Tensor, targets: list[int], top_k: int = 0
                          ) -> tuple[list[float], list[list[tuple[int, float]]] | None, list[int]]:
    """Of a scored pass's logits [T, V] and the token that came at each row:
    its logprob, the top_k most likely (token, logprob) pairs (None for 0)
    and its rank (1: the most likely)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(targets, device=logprobs.device)[:, None])
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    chosen = chosen[:, 0].tolist()
    if not top_k:
        return chosen, None, ranks
    vals, ids = logprobs.topk(top_k, dim=-1)
    return chosen, [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())], ranks
