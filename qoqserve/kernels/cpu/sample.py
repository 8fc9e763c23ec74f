"""Sampling rows of logits on CPU (sample.c), via ctypes: temperature,
min_p, top_k and top_p without sorting the vocabulary, one uniform per row."""
from __future__ import annotations

import ctypes

import torch

from qoqserve.kernels.cpu.build import load_library

_P, _L = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {"sample_rows": (ctypes.c_int, [_P, _L, _L, _P, _L, _P, _P, _P, _P, _P, _P, ctypes.c_int])}


def load():
    return load_library("sample", [], _SIGNATURES, fallback="torch's sort-based sampling")


def available() -> bool:
    return load() is not None


def sample_rows(logits: torch.Tensor, rows: list[int], temperature: list[float], min_p: list[float],
                top_k: list[int], top_p: list[float], u: list[float], threads: int | None = None) -> list[int]:
    """One token from each row rows[j] of fp32 logits [B, V] (unit column
    stride): sample.c's rules, u[j] in [0, 1) the row's uniform. Settings are
    taken as valid (SamplingParams checked them): temperature > 0, min_p in
    [0, 1], top_p in (0, 1], top_k <= 0 for none."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.stride(1) != 1:
        raise ValueError("sample_rows: fp32 CPU logits with unit column stride")
    n = len(rows)
    if not n:
        return []
    out = torch.empty(n, dtype=torch.int64)
    args = (torch.tensor(rows, dtype=torch.int64), torch.tensor(temperature, dtype=torch.float32),
            torch.tensor(min_p, dtype=torch.float32), torch.tensor(top_k, dtype=torch.int64),
            torch.tensor(top_p, dtype=torch.float32), torch.tensor(u, dtype=torch.float64))
    status = load().sample_rows(logits.data_ptr(), logits.stride(0), logits.shape[1], args[0].data_ptr(), n,
                                *(a.data_ptr() for a in args[1:]), out.data_ptr(),
                                threads or torch.get_num_threads())
    if status == -2:
        raise MemoryError("sample_rows: out of memory")
    if status == -1:
        raise ValueError("sample_rows: a row has no finite logit")
    return out.tolist()
