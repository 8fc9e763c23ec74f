"""The quantizer's level-2 group search on CPU (group_search.c), via ctypes."""
from __future__ import annotations

import ctypes

import torch

from qoqserve.kernels.cpu.build import load_library

_P = ctypes.c_void_p
_SIGNATURES = {"group_search": (ctypes.c_int, [_P, ctypes.c_int64, ctypes.c_int, _P, ctypes.c_float, _P, _P,
                                               ctypes.c_int])}
CHUNK = 32  # the group sizes it takes: multiples of this (the reference's summation order is known for them)


def load():
    # -ffp-contract=off: no fused multiply-adds, the reference's roundings exactly
    return load_library("group_search", ["-ffp-contract=off"], _SIGNATURES, fallback="the torch group search")


def handles(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dim() == 2 and x.shape[1] % CHUNK == 0 and load() is not None


def group_search(x: torch.Tensor, col_weight: torch.Tensor, min_ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, g] fp32 level-1 values, clamped; col_weight [g] fp32. (s2, z) as in
    quant/group_search.search_group_params, bit for bit."""
    x, w = x.float().contiguous(), col_weight.float().contiguous()
    n, g = x.shape
    if w.shape != (g,):
        raise ValueError(f"col_weight must be [{g}], got {tuple(w.shape)}")
    s2, z = torch.empty(n), torch.empty(n)
    rc = load().group_search(x.data_ptr(), n, g, w.data_ptr(), min_ratio, s2.data_ptr(), z.data_ptr(),
                             torch.get_num_threads())
    if rc:
        raise ValueError(f"group_search: group size {g} is not a multiple of {CHUNK}")
    return s2, z
