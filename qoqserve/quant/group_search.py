"""Level-2 group parameters chosen by error, not by range.

Round-to-nearest takes s2 = ceil(range / 15): the integer ceiling alone can
waste most of a code step, and one outlier stretches the whole group. Here
every integer s2 from that value down to ~55% of it is tried, with every zero
point that keeps s2*(u - z) inside INT8, and the pair with the smallest
(activation-weighted) squared error on the group's unrounded values wins.
The result is still the QoQ format; only the choice of (s2, z) differs.
"""
from __future__ import annotations

import math

import torch

from qoqserve.kernels.cpu import group_search as cpu_kernel
from qoqserve.kernels.qoq_ref import PROTECT

_CODES = torch.arange(16, dtype=torch.float32)


def search_group_params(x: torch.Tensor, col_weight: torch.Tensor | None = None,
                        min_ratio: float = 0.55, kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x: level-1 values (w / s1, unrounded) of one group per row [N, g];
    col_weight: [g] importance of each column (e.g. diag of the Hessian) or None.
    Returns (s2, z) as float tensors [N] holding integers (s2 in 1..16, z in 0..15).
    kernel: on CPU, the C search (the same choices bit for bit, ~an order of
    magnitude faster: the quantizer calls this once per group of every linear)
    where it takes the group size; False: the torch reference below."""
    x = x.float().clamp(-PROTECT, PROTECT)
    w = torch.ones(x.shape[-1], device=x.device) if col_weight is None else col_weight.float()
    if kernel and cpu_kernel.handles(x):
        return cpu_kernel.group_search(x, w, min_ratio)
    q1 = torch.round(x)
    lo = q1.amin(dim=-1).clamp(max=0)
    hi = q1.amax(dim=-1).clamp(min=0)
    s2_max = torch.clamp(torch.ceil((hi - lo) / 15), min=1)
    best_err = torch.full_like(lo, math.inf)
    best_s2, best_z = s2_max.clone(), torch.zeros_like(lo)
    z_all = _CODES.to(x.device)
    for s2v in range(16, 0, -1):
        # rows for which this s2 is a candidate: between min_ratio*s2_max and s2_max
        rows = (s2v <= s2_max) & (s2v >= torch.floor(min_ratio * s2_max))
        if not rows.any():
            continue
        xr, q1r = x[rows], q1[rows]
        z_lo = max(15 - 127 // s2v, 0)
        z_hi = min(128 // s2v, 15)
        z = z_all[z_lo:z_hi + 1]                                  # [Z]
        u = torch.clamp(torch.round(q1r / s2v)[:, None, :] + z[None, :, None], 0, 15)
        deq = s2v * (u - z[None, :, None])                        # [R, Z, g]
        err = ((deq - xr[:, None, :]) ** 2 * w).sum(dim=-1)       # [R, Z]
        e, zi = err.min(dim=1)
        better = e < best_err[rows]
        idx = rows.nonzero().squeeze(1)[better]
        best_err[idx] = e[better]
        best_s2[idx] = float(s2v)
        best_z[idx] = z[zi[better]]
    return best_s2, best_z
