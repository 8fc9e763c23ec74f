"""Causal fp64 attention over dense fp32 q/k/v on CPU (dense_attention_f64.c), via ctypes."""
from __future__ import annotations

import ctypes

import torch

from qoqserve.kernels.cpu import graph
from qoqserve.kernels.cpu.build import load_library, runtime_dispatch_flags

_P, _L, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {"dense_attention_f64": (_I, [_P, _P, _P, _P, _L, _L, _L, _I, _I, _I, ctypes.c_double, _I]),
               "dense_attention_f64_supported": (_I, [])}


def load():
    # no FMA contraction beyond the explicit intrinsics: the AVX2 and AVX-512
    # paths then round the same operations and give the same bits
    return load_library("dense_attention_f64", ["-ffp-contract=off", *runtime_dispatch_flags()], _SIGNATURES,
                        fallback="torch's fp64 SDPA")


def vector_path() -> str | None:
    """The path attention() takes on this CPU under the current QOQSERVE_CPU_ISA."""
    lib = load()
    return {2: "avx512", 1: "avx2"}.get(lib.dense_attention_f64_supported()) if lib is not None else None


def handles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> bool:
    """Whether attention() runs for these inputs here (else: torch's fp64 SDPA)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return False  # no backward here: training (the learned rotation) needs torch's
    lib = load()
    return (lib is not None and bool(lib.dense_attention_f64_supported())
            and all(t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 3 for t in (q, k, v))
            and q.shape[2] % 8 == 0 and k.shape == v.shape and k.shape[2] == q.shape[2]
            and q.shape[1] % k.shape[1] == 0 and k.shape[0] == offset + q.shape[0])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, scale: float) -> torch.Tensor:
    """q [Lq, H, D], k/v [offset + Lq, Hkv, D] fp32 on CPU (handles() true): query i
    attends to keys 0 .. offset + i, computed in fp64, returned [Lq, H, D] fp32."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = graph.empty(*q.shape, dtype=torch.float32)
    rc = graph.launch(load().dense_attention_f64, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                      q.shape[0], k.shape[0], offset, q.shape[1], k.shape[1], q.shape[2], scale,
                      torch.get_num_threads())
    if rc:
        raise MemoryError("dense_attention_f64: out of memory")
    return out
