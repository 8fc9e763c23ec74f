"""One token drawn from each of some rows of logits: temperature, then
vLLM's min_p, top_k and top_p, then an inverse-CDF draw with the row's own
uniform u in [0, 1) (so a seeded request's tokens do not depend on its batch).

The rules (kernels/cpu/sample.c states them exactly): a row's weights are
w = exp((logits - max) / T), the top token weighing 1; min_p drops w below
min_p; top_k keeps the k heaviest (and ties with the k-th); top_p keeps a
token while the weight heavier than it is below top_p of the rest (ties
together); the token is the first, in vocabulary order, where the running
sum of kept weights passes u times their sum.

On CPU the C kernel runs them without sorting the vocabulary (docs/runtime.md
has its cost beside torch's sort-based filters); elsewhere (CUDA) the same
rules run batched in torch.
"""
from __future__ import annotations

import torch

from qoqserve.kernels.cpu import sample as cpu_sample
from qoqserve.sampling_params import SamplingParams


def draw_settings(params: list[SamplingParams]) -> tuple[list[float], list[float], list[int], list[float]]:
    """(temperatures, min_ps, top_ks, top_ps) of these rows, as the kernels take them."""
    return ([p.temperature for p in params], [p.min_p for p in params], [p.top_k for p in params],
            [p.top_p for p in params])


def draw_tokens(logits: torch.Tensor, rows: list[int], params: list[SamplingParams], u: list[float]) -> list[int]:
    """The token of each row rows[j] of fp32 logits [B, V], drawn by params[j]
    (temperature > 0) with uniform u[j]."""
    settings = draw_settings(params)
    if logits.device.type == "cpu" and logits.stride(1) == 1 and cpu_sample.available():
        return cpu_sample.sample_rows(logits, rows, *settings, u)
    return draw_torch(logits[rows], *settings, u)


def draw_torch(logits: torch.Tensor, temperature: list[float], min_p: list[float], top_k: list[int],
               top_p: list[float], u: list[float]) -> list[int]:
    """The same rules, batched in torch over fp32 logits [n, V] (one row per draw)."""
    dev, vocab = logits.device, logits.shape[1]
    col = lambda v, dtype=torch.float32: torch.tensor(v, dtype=dtype, device=dev)[:, None]  # noqa: E731
    top = torch.nan_to_num(logits, nan=float("-inf")).max(dim=-1, keepdim=True).values
    inf_top = torch.isposinf(top)  # a penalty overflowed: the +inf tokens share the draw
    d = logits - torch.where(inf_top, 0.0, top)
    w = torch.exp(torch.where(d == 0, 0.0, d / col(temperature)))  # the top token weighs 1, even at T -> 0
    w = torch.where(inf_top, torch.isposinf(logits).float(), torch.nan_to_num(w, nan=0.0))
    w = torch.where(w < col(min_p), 0.0, w)
    k = col(top_k, torch.int64)
    if bool(((k > 0) & (k < vocab)).any()):
        desc = w.sort(dim=-1, descending=True).values
        kth = desc.gather(1, (k.clamp(1, vocab) - 1))
        w = torch.where((k > 0) & (w < kth), 0.0, w)
    p = col(top_p)
    if bool((p < 1).any()):
        desc = w.sort(dim=-1, descending=True).values
        heavier = desc.cumsum(-1) - desc  # weight before each sorted position (ties: the first's is theirs)
        kept = heavier < p * desc.sum(-1, keepdim=True)
        least = torch.where(kept, desc, float("inf")).min(dim=-1, keepdim=True).values
        w = torch.where(w < least, 0.0, w)
    cdf = w.double().cumsum(-1)
    target = col(u, torch.float64) * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).clamp(max=vocab - 1)[:, 0].tolist()
