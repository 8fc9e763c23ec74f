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


def scored_windows(num_ids: int, window: int, stride: int):
    """(begin, end, first) of each window: it runs on ids[begin:end] and scores
    ids[first:end], the tokens no earlier window scored. The scores of a
    window's pass come as rows 0..end-begin-2 (row j predicts ids[begin+j+1]),
    so ids[first:end] are rows first-begin-1 onwards."""
    if stride < 1 or window < 2 or stride > window:
        raise ValueError(f"need window >= 2 and 1 <= stride <= window (got {window}, {stride})")
    if num_ids < 2:
        raise ValueError("text is too short: need at least 2 tokens")
    prev_end = 0
    for begin in range(0, num_ids - 1, stride):
        end = min(begin + window, num_ids)
        yield begin, end, max(prev_end, begin + 1)
        prev_end = end
        if end == num_ids:
            return


def num_windows(num_ids: int, window: int, stride: int) -> int:
    return sum(1 for _ in scored_windows(num_ids, window, stride))


def perplexity(logprob_fn: Callable[[list[int]], torch.Tensor], ids: list[int],
               window: int, stride: int, progress: bool = False) -> PerplexityResult:
    """logprob_fn(window_ids) -> log p(ids[i+1] | ids[:i+1]) for each i (len-1 values)."""
    total, count = 0.0, 0
    windows = scored_windows(len(ids), window, stride)
    bar = tqdm(windows, total=num_windows(len(ids), window, stride), desc="perplexity", unit="window",
               disable=not progress)
    for begin, end, first in bar:
        scored = logprob_fn(ids[begin:end])[first - begin - 1:]
        total -= float(scored.double().sum())
        count += scored.numel()
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
