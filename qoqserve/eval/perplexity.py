"""Perplexity of a token stream with a sliding window.

Window w, stride s: windows start every s tokens; each window scores only the
tokens the previous window did not (the first token of the stream has no
context and is never scored). s == w gives disjoint chunks, whose first token
is unscored too, exactly as the usual HF recipe computes it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm import tqdm


@dataclass
class PerplexityResult:
    ppl: float
    nll: float            # mean negative log-likelihood per scored token
    num_tokens: int       # tokens scored
    window: int
    stride: int


def perplexity(logprob_fn: Callable[[list[int]], torch.Tensor], ids: list[int],
               window: int, stride: int, progress: bool = False) -> PerplexityResult:
    """logprob_fn(window_ids) -> log p(ids[i+1] | ids[:i+1]) for each i (len-1 values)."""
    if stride < 1 or window < 2 or stride > window:
        raise ValueError(f"need window >= 2 and 1 <= stride <= window (got {window}, {stride})")
    if len(ids) < 2:
        raise ValueError("text is too short: need at least 2 tokens")
    total, count, prev_end = 0.0, 0, 0
    starts = list(range(0, len(ids) - 1, stride))
    bar = None
    if progress:
        bar = tqdm(total=len(starts), desc="perplexity", unit="window")
    for begin in starts:
        end = min(begin + window, len(ids))
        lp = logprob_fn(ids[begin:end])        # lp[j] scores ids[begin + j + 1]
        first = max(prev_end, begin + 1)
        scored = lp[first - begin - 1:]
        total -= float(scored.double().sum())
        count += scored.numel()
        prev_end = end
        if bar:
            bar.update(1)
        if end == len(ids):
            break
    if bar:
        bar.close()
    nll = total / count
    return PerplexityResult(math.exp(nll), nll, count, window, stride)


LICENSE_TEXTS = ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0")


def read_texts(paths) -> str:
    """Files concatenated with a blank line between them."""
    parts = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            parts.append(f.read())
    return "\n\n".join(parts)
