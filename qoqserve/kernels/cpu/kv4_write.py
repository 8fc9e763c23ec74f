"""KV page writes on CPU (kv4_write.c), via ctypes: KV4 (quantize and store
one step's K and V in one call, byte-identical to the torch layout's write)
and dense pages (copy the rows to their slots)."""
from __future__ import annotations

import ctypes

import torch

from qoqserve.kernels.cpu import graph
from qoqserve.kernels.cpu.build import load_library

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_SIGNATURES = {"kv4_write": (None, [_P, _P, _I, _P, _L, _I, _I, _P, _I]),
               "kv_copy_rows": (None, [_P, _P, _L, _P, _L, _P, _P, _L])}


def load():
    # no FMA contraction: the reference rounds x / scale and + zero separately
    return load_library("kv4_write", ["-ffp-contract=off"], _SIGNATURES, team_aware=("kv4_write",),
                        serial=("kv_copy_rows",))


def available() -> bool:
    return load() is not None


@torch.library.custom_op("qoqserve::kv4_write", mutates_args=("cache",))
def kv4_write_op(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv4_write as one opaque op of a captured graph (writes `cache` in place)."""
    _kv4_write(cache, k, v, slot_mapping)


@kv4_write_op.register_fake
def _(cache, k, v, slot_mapping):
    return None


def kv4_write(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] -> their rows of the KV4 page pool `cache` (uint8
    [blocks, block_size, 2, Hkv, D/2 + 4]) at flat slots `slot_mapping`."""
    if torch.compiler.is_compiling():
        kv4_write_op(cache, k, v, slot_mapping)
    else:
        _kv4_write(cache, k, v, slot_mapping)


def _kv4_write(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    t, hkv, d = k.shape
    if cache.shape[-2:] != (hkv, d // 2 + 4) or d % 2 or not cache.is_contiguous():
        raise ValueError(f"unsupported shapes: k {tuple(k.shape)}, pages {tuple(cache.shape)}")
    work = k.dtype if k.dtype in (torch.float32, torch.bfloat16) else torch.float32  # fp16: exact in fp32
    kc, vc = k.to(work).contiguous(), v.to(work).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    graph.launch(load().kv4_write, kc.data_ptr(), vc.data_ptr(), int(work == torch.bfloat16), slots.data_ptr(), t, hkv,
                     d, cache.data_ptr(), torch.get_num_threads())


def dense_write(k_rows: torch.Tensor, v_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] (contiguous, the pages' dtype) -> rows `slot_mapping` of
    the page views k_rows, v_rows [num_slots, Hkv, D] (equal strides)."""
    if (k.dtype != k_rows.dtype or not (k.is_contiguous() and v.is_contiguous())
            or k_rows.stride() != v_rows.stride() or k_rows[0].numel() != k[0].numel()
            or not k_rows[0].is_contiguous() or slot_mapping.dtype != torch.int64):
        raise ValueError("dense_write: contiguous K/V rows in the pages' dtype, int64 slots")
    size = k.element_size()
    graph.launch(load().kv_copy_rows, k.data_ptr(), v.data_ptr(), k[0].numel() * size,
                 slot_mapping.data_ptr(), k.shape[0], k_rows.data_ptr(), v_rows.data_ptr(),
                 k_rows.stride(0) * size)
