"""Per-output-channel clip-ratio grid search (QoQ weight range search).

Shrinking a row's range trades clipping of its largest weights for finer steps
on all others; the ratio is chosen to minimise the row's *output* error on
calibration tokens, ||x (w_n - q(w_n; r))^T||^2, not its weight error.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

DEFAULT_GRID = tuple(round(1.0 - 0.05 * i, 2) for i in range(17))  # 1.0, 0.95, ..., 0.2


def search_clip_ratios(w: torch.Tensor, x: torch.Tensor,
                       quantize_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                       grid: Sequence[float] = DEFAULT_GRID,
                       max_chunk_bytes: int = 256 << 20) -> torch.Tensor:
    """Best clip ratio per row of w [N, K] for tokens x [T, K] -> fp32 [N].

    quantize_fn(w_rows [n, K], ratios [n]) must return the dequantized rows
    (fp32 [n, K]), e.g. ``lambda w, r: group_weight_to_float(
    quantize_weight_group(w, 128, r))``. Ratio 1.0 is always tried first and a
    candidate replaces the best only if strictly better, so the result never
    scores worse than no clipping.
    """
    w = w.float()
    x = x.reshape(-1, x.shape[-1]).float()
    n, k = w.shape
    t = x.shape[0]
    grid = [1.0] + [float(r) for r in grid if float(r) != 1.0]
    # With more tokens than inputs, e^T (X^T X) e is cheaper than ||X e||^2
    # and touches a [K, K] Gram matrix instead of [T, K] per row.
    gram = x.t() @ x if t > k else None
    width = min(t, k) if gram is None else k
    chunk = max(1, min(n, max_chunk_bytes // (4 * 3 * max(width, k))))

    best_r = torch.ones(n, device=w.device)
    for c0 in range(0, n, chunk):
        wc = w[c0:c0 + chunk]
        best_err = None
        for r in grid:
            ratios = torch.full((wc.shape[0],), r, device=w.device)
            e = quantize_fn(wc, ratios).float() - wc
            if gram is None:
                err = (e @ x.t()).square().sum(dim=1)
            else:
                err = ((e @ gram) * e).sum(dim=1)
            if best_err is None:
                best_err = err
                continue
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_r[c0:c0 + chunk] = torch.where(better, torch.full_like(err, r),
                                                best_r[c0:c0 + chunk])
    return best_r
