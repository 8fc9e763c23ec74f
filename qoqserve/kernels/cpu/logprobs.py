"""Log-probabilities of rows of logits on CPU (logprobs.c), via ctypes: each
row's max and log-sum and its k most likely tokens, as torch.log_softmax and
topk give them, without the [rows, V] log_softmax in memory."""
from __future__ import annotations

import ctypes

import torch

from qoqserve.kernels.cpu import graph
from qoqserve.kernels.cpu.build import load_library

MAX_K = 64  # logprobs.c's
_P, _L = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {"logprob_rows": (ctypes.c_int, [_P, _L, _L, _P, _L, _L, _P, _P, _P, _P, ctypes.c_int]),
               "logprob_step": (ctypes.c_int, [_P, _L, _L, _L, _P, _P, _L, _P, _P, _P, ctypes.c_int])}


def load():
    return load_library("logprobs", [], _SIGNATURES, fallback="torch.log_softmax", team_aware=("logprob_step",))


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


def logprob_step(logits: torch.Tensor, chosen: torch.Tensor, step: torch.Tensor, k: int, out_lp: torch.Tensor,
                 top_id: torch.Tensor, top_lp: torch.Tensor) -> None:
    """A decode burst's logprobs of one step (recorded after its draw): for
    each row i of fp32 logits [rows, V], out_lp[step[0], i] = chosen[i]'s
    logprob and top_id / top_lp [step[0], i] its k most likely, as
    logprob_rows gives them. Buffers: int64 chosen [rows], step [1], top_id
    [steps, rows, k]; fp32 out_lp [steps, rows], top_lp [steps, rows, k]."""
    rows = chosen.shape[0]
    if (logits.dtype != torch.float32 or logits.stride(1) != 1 or logits.shape[0] < rows
            or not 0 <= k <= min(MAX_K, logits.shape[1]) or out_lp.shape[1:] != (rows,)
            or top_id.shape[1:] != (rows, k) or top_lp.shape[1:] != (rows, k)
            or any(not t.is_contiguous() for t in (chosen, step, out_lp, top_id, top_lp))
            or (chosen.dtype, step.dtype, out_lp.dtype, top_id.dtype, top_lp.dtype)
            != (torch.int64, torch.int64, torch.float32, torch.int64, torch.float32)):
        raise ValueError("logprob_step: fp32 logits rows, int64 chosen/step/top_id, fp32 out_lp/top_lp "
                         "[steps, rows(, k)]")
    status = graph.launch(load().logprob_step, logits.data_ptr(), logits.stride(0), logits.shape[1], rows,
                          chosen.data_ptr(), step.data_ptr(), k, out_lp.data_ptr(), top_id.data_ptr(),
                          top_lp.data_ptr(), torch.get_num_threads())
    if status:
        raise RuntimeError(f"logprob_step failed ({status})")
