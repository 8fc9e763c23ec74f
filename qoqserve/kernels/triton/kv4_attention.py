"""KV4 paged cache kernels: quantize-and-write of new K/V into their page slots
(layout: qoqserve.layers.kv_cache.Int4KVCacheLayout), and the decode
attention that reads them (qoqserve.kernels.triton.paged_decode)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qoqserve.kernels.triton.common import rint
from qoqserve.kernels.triton.paged_decode import kv4_decode_attention  # noqa: F401  (public API)


@triton.jit
def _kv4_write_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                      HKV, D: tl.constexpr, D_PAD: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    kind = tl.program_id(2)  # 0: K, 1: V
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # slot < 0 marks a padded token (e.g. a CUDA-graph batch slot): nothing to write
    if slot >= 0:
        ROW: tl.constexpr = D // 2 + 4
        cols = tl.arange(0, D_PAD)
        ok = cols < D
        if kind == 0:
            x = tl.load(k_ptr + t * stride_kt + h * stride_kh + cols, mask=ok, other=0.0).to(tl.float32)
        else:
            x = tl.load(v_ptr + t * stride_vt + h * stride_vh + cols, mask=ok, other=0.0).to(tl.float32)
        lo = tl.min(tl.where(ok, x, float("inf")), axis=0)
        hi = tl.max(tl.where(ok, x, float("-inf")), axis=0)
        amax = tl.maximum(tl.abs(lo), tl.abs(hi))
        # same formula as kv_ref.quantize_kv4 (see there for the 2^-14 floor);
        # 5.96e-8 is 2^-24, the smallest fp16, as a literal (no globals in jit code)
        scale16 = tl.maximum(tl.math.div_rn(hi - lo, 15.0), amax * 0.00006103515625).to(tl.float16)
        scale = scale16.to(tl.float32)
        scale = tl.where(scale > 0, scale, 5.960464477539063e-08)
        scale16 = scale.to(tl.float16)
        zero16 = tl.math.div_rn(-lo, scale).to(tl.float16)
        codes = rint(tl.math.div_rn(x, scale) + zero16.to(tl.float32))
        codes = tl.minimum(tl.maximum(codes, 0.0), 15.0).to(tl.uint8)
        even, odd = tl.split(tl.reshape(codes, (D_PAD // 2, 2)))
        row = cache_ptr + slot * (2 * HKV * ROW) + kind * (HKV * ROW) + h * ROW
        half = tl.arange(0, D_PAD // 2)
        tl.store(row + half, (even | (odd << 4)).to(tl.uint8), mask=half < D // 2)
        sbits = scale16.to(tl.uint16, bitcast=True)
        zbits = zero16.to(tl.uint16, bitcast=True)
        tl.store(row + D // 2, (sbits & 0xFF).to(tl.uint8))
        tl.store(row + D // 2 + 1, (sbits >> 8).to(tl.uint8))
        tl.store(row + D // 2 + 2, (zbits & 0xFF).to(tl.uint8))
        tl.store(row + D // 2 + 3, (zbits >> 8).to(tl.uint8))


def kv4_write(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize k, v [T, Hkv, D] per token and head and store them at their
    slots; tokens whose slot is negative are skipped."""
    t, hkv, d = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if cache.dim() != 5 or cache.dtype != torch.uint8 or not cache.is_contiguous() \
            or cache.shape[3] != hkv or cache.shape[4] != d // 2 + 4:
        raise ValueError(f"cache {tuple(cache.shape)} {cache.dtype} is not a contiguous KV4 pool "
                         f"for {hkv} heads of dim {d}")
    if slot_mapping.shape != (t,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 [{t}], got {tuple(slot_mapping.shape)} "
                         f"{slot_mapping.dtype}")
    if t == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    _kv4_write_kernel[(t, hkv, 2)](k, v, cache, slot_mapping, k.stride(0), k.stride(1),
                                   v.stride(0), v.stride(1), hkv, D=d,
                                   D_PAD=triton.next_power_of_2(max(d, 16)), num_warps=1)
