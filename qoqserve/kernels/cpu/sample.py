"""Sampling rows of logits on CPU (sample.c), via ctypes: temperature,
min_p, top_k and top_p without sorting the vocabulary, one uniform per row."""
from __future__ import annotations

import array
import ctypes

import torch

from qoqserve.kernels.cpu import graph
from qoqserve.kernels.cpu.build import load_library

_P, _L = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {"sample_rows": (ctypes.c_int, [_P, _L, _L, _P, _L, _P, _P, _P, _P, _P, _P, ctypes.c_int]),
               "penalize_rows": (ctypes.c_int, [_P, _L, _L, _P, _L] + [_P] * 11),
               "sample_step": (ctypes.c_int, [_P, _L, _L, _P, _L, _P, _P, _P, _P, _P, _P, _P, ctypes.c_int])}


def load():
    # -ffp-contract=off: penalize_rows rounds as torch does (each product and sum on its own)
    return load_library("sample", ["-ffp-contract=off"], _SIGNATURES, fallback="the torch sampling path",
                        team_aware=("sample_step",))


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


def _pointers(arrays: list[array.array]) -> tuple[ctypes.Array, ctypes.Array]:
    """(a pointer to each array's items, their lengths) as C arrays."""
    ptrs = (ctypes.c_void_p * len(arrays))(*(a.buffer_info()[0] for a in arrays))
    lens = (ctypes.c_int64 * len(arrays))(*(len(a) for a in arrays))
    return ptrs, lens


def penalize_rows(logits: torch.Tensor, rows: list[int], seen: list[list[int]],
                  outputs: list[dict[int, int]], biases: list[dict[int, float] | None],
                  repetition: list[float], presence: list[float], frequency: list[float]) -> None:
    """In place, rows rows[j] of fp32 CPU logits [B, V]: sampler.apply_penalties
    bit for bit, for each row j: repetition[j] on the distinct tokens of seen[j]
    (prompt and output), presence / frequency on the counts outputs[j], the
    logit bias biases[j] last."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.stride(1) != 1:
        raise ValueError("penalize_rows: fp32 CPU logits with unit column stride")
    if not rows:
        return
    seen_a = [array.array("q", s) for s in seen]
    tok_a = [array.array("q", o.keys()) for o in outputs]
    cnt_a = [array.array("f", o.values()) for o in outputs]
    btok_a = [array.array("q", (b or {}).keys()) for b in biases]
    bval_a = [array.array("f", (b or {}).values()) for b in biases]
    f32 = lambda v: (ctypes.c_float * len(v))(*v)  # noqa: E731
    (tok_p, out_len), (btok_p, bias_len) = _pointers(tok_a), _pointers(btok_a)
    status = load().penalize_rows(
        logits.data_ptr(), logits.stride(0), logits.shape[1], (ctypes.c_int64 * len(rows))(*rows), len(rows),
        *_pointers(seen_a), tok_p, _pointers(cnt_a)[0], out_len, btok_p, _pointers(bval_a)[0], bias_len,
        f32(repetition), f32(presence), f32(frequency))
    if status == -1:
        raise ValueError("penalize_rows: a token id outside the vocabulary")
    if status == -2:
        raise MemoryError("penalize_rows: out of memory")


def sample_step(logits: torch.Tensor, greedy: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor,
                top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor, step: torch.Tensor,
                chosen: torch.Tensor) -> None:
    """A decode burst's choice of each row's token (recorded into its plan):
    chosen[i] = greedy[i] where temperature[i] is 0, else sample_rows' draw from
    logits[i] with u[step[0], i]. Buffers: fp32 logits [rows, V], int64 greedy /
    top_k / chosen / step [1], fp32 temperature / min_p / top_p, float64 u [steps, rows]."""
    rows = chosen.shape[0]
    typed = ((greedy, torch.int64), (top_k, torch.int64), (chosen, torch.int64), (step, torch.int64),
             (temperature, torch.float32), (min_p, torch.float32), (top_p, torch.float32), (u, torch.float64))
    if (logits.dtype != torch.float32 or logits.stride(1) != 1 or logits.shape[0] < rows or u.shape[1:] != (rows,)
            or any(t.dtype != d or not t.is_contiguous() or (t is not u and t is not step and t.shape[0] < rows)
                   for t, d in typed)):
        raise ValueError("sample_step: fp32 logits rows, contiguous buffers of its rows, u [steps, rows] float64")
    status = graph.launch(load().sample_step, logits.data_ptr(), logits.stride(0), logits.shape[1], greedy.data_ptr(),
                          rows, temperature.data_ptr(), min_p.data_ptr(), top_k.data_ptr(), top_p.data_ptr(),
                          u.data_ptr(), step.data_ptr(), chosen.data_ptr(), torch.get_num_threads())
    if status:
        raise RuntimeError(f"sample_step failed ({status})")
