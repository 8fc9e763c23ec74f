"""Log-probabilities of rows of logits on CPU (logprobs.c), via ctypes: each
row's max and log-sum and its k most likely tokens, as torch.log_softmax and
topk give them, without the [rows, V] log_softmax in memory."""
from __future__ import annotations

import ctypes

import torch

from qoqserve.kernels.cpu.build import load_library

MAX_K = 64  # logprobs.c's
_P, _L = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {"logprob_rows": (ctypes.c_int, [_P, _L, _L, _P, _L, _L, _P, _P, _P, _P, ctypes.c_int])}


def load():
    return load_library("logprobs", [], _SIGNATURES, fallback="torch.log_softmax")


def available() -> bool:
    return load() is not None


def takes(logits: torch.Tensor) -> bool:
    return (logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.stride(1) == 1
            and available())


def logprob_rows(logits: torch.Tensor, rows: list[int], k: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows rows[j] of fp32 CPU logits [B, V], each holding a finite logit:
    (shift [n], logsum [n], top ids [n, k], top logprobs [n, k]); a token's
    logprob is (logit - shift) - logsum, the top ones largest first (ties:
    lower id first)."""
    if not takes(logits):
        raise ValueError("logprob_rows: fp32 CPU logits with unit column stride")
    if not 0 <= k <= min(MAX_K, logits.shape[1]):
        raise ValueError(f"logprob_rows: k must be in [0, {min(MAX_K, logits.shape[1])}], got {k}")
    n = len(rows)
    shift, logsum = torch.empty(n), torch.empty(n)
    top_id, top_lp = torch.empty(n, k, dtype=torch.int64), torch.empty(n, k)
    idx = torch.tensor(rows, dtype=torch.int64)
    load().logprob_rows(logits.data_ptr(), logits.stride(0), logits.shape[1], idx.data_ptr(), n, k,
                        shift.data_ptr(), logsum.data_ptr(), top_id.data_ptr(), top_lp.data_ptr(),
                        torch.get_num_threads())
    return shift, logsum, top_id, top_lp
