"""Next-token distributions of a model against a reference on the same text:
KL divergence and top-1 agreement, as llama.cpp's `perplexity
--kl-divergence` reports them.

Per scored token, with P the reference (FP) distribution and Q the tested
one: KL(P || Q) = sum_v P(v) (log P(v) - log Q(v)); "same top" is
argmax P == argmax Q. Reported: the mean and the 99th percentile of KL over
all scored tokens, and the same-top rate. The tokens scored are perplexity's
(eval/perplexity.py windows), and both perplexities come from the same
passes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from qoqserve.eval.perplexity import num_windows, scored_windows
from qoqserve.eval.subject import LogitsFn


@dataclass
class KLResult:
    kl_mean: float
    kl_median: float
    kl_p99: float
    kl_max: float
    same_top: float       # share of tokens whose argmax agrees with the reference's
    ppl: float            # of the tested model
    ref_ppl: float
    num_tokens: int


def token_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(P_ref || P) per row of [n, vocab] logits (fp32 softmax, >= 0)."""
    ref_lp = torch.log_softmax(ref_logits.float(), dim=-1)
    lp = torch.log_softmax(logits.float(), dim=-1)
    return (ref_lp.exp() * (ref_lp - lp)).sum(-1).clamp_min(0.0)


def compare(ref_fn: LogitsFn, fn: LogitsFn, ids: list[int], window: int, stride: int,
            progress: bool = False) -> KLResult:
    kls, same, nll, ref_nll = [], 0, 0.0, 0.0
    windows = scored_windows(len(ids), window, stride)
    for begin, end, first in tqdm(windows, total=num_windows(len(ids), window, stride), desc="kl",
                                  unit="window", disable=not progress):
        chunk = ids[begin:end]
        rows = list(range(first - begin - 1, end - begin - 1))
        ref, test = ref_fn(chunk, rows), fn(chunk, rows)
        targets = torch.tensor(chunk[first - begin:], device=ref.device)[:, None]
        kls.append(token_kl(ref, test).cpu())
        same += int((ref.argmax(-1) == test.argmax(-1)).sum())
        nll -= float(torch.log_softmax(test.float(), -1).gather(1, targets).double().sum())
        ref_nll -= float(torch.log_softmax(ref.float(), -1).gather(1, targets).double().sum())
    kl = torch.cat(kls).double()
    n = kl.numel()
    return KLResult(float(kl.mean()), float(kl.quantile(0.5)), float(kl.quantile(0.99)), float(kl.max()),
                    same / n, math.exp(nll / n), math.exp(ref_nll / n), n)
