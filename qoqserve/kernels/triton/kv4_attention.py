"""KV4 paged cache kernels: quantize-and-write of new K/V, and decode attention
that reads UINT4 pages with their inline fp16 scale/zero (layout:
qoqserve.layers.kv_cache.Int4KVCacheLayout) and dequantizes in registers.

Decode: one program per (sequence, KV head) handles all the query heads that
share that KV head (GQA), so each page is read from memory once; online
softmax in fp32 over tiles of BLOCK_N tokens gathered through the block table.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qoqserve.kernels.qoq_ref import _FP16_TINY
from qoqserve.kernels.triton.common import fp16_from_bytes, rint, unpack_uint4


@triton.jit
def _kv4_write_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                      HKV, D: tl.constexpr, D_PAD: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    kind = tl.program_id(2)  # 0: K, 1: V
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
    # same formula as qoq_ref.quantize_kv4 (see there for the 2^-14 floor)
    scale16 = tl.maximum(tl.math.div_rn(hi - lo, 15.0), amax * 0.00006103515625).to(tl.float16)
    scale = scale16.to(tl.float32)
    scale = tl.where(scale > 0, scale, _FP16_TINY)
    scale16 = scale.to(tl.float16)
    zero16 = tl.math.div_rn(-lo, scale).to(tl.float16)
    codes = rint(tl.math.div_rn(x, scale) + zero16.to(tl.float32))
    codes = tl.minimum(tl.maximum(codes, 0.0), 15.0).to(tl.uint8)
    even, odd = tl.split(tl.reshape(codes, (D_PAD // 2, 2)))
    slot = tl.load(slot_ptr + t).to(tl.int64)
    row = cache_ptr + slot * (2 * HKV * ROW) + kind * (HKV * ROW) + h * ROW
    half = tl.arange(0, D_PAD // 2)
    tl.store(row + half, even | (odd << 4), mask=half < D // 2)
    sbits = scale16.to(tl.uint16, bitcast=True)
    zbits = zero16.to(tl.uint16, bitcast=True)
    tl.store(row + D // 2, (sbits & 0xFF).to(tl.uint8))
    tl.store(row + D // 2 + 1, (sbits >> 8).to(tl.uint8))
    tl.store(row + D // 2 + 2, (zbits & 0xFF).to(tl.uint8))
    tl.store(row + D // 2 + 3, (zbits >> 8).to(tl.uint8))


def kv4_write(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize k, v [T, Hkv, D] per token and head and store them at their slots."""
    t, hkv, d = k.shape
    if t == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    _kv4_write_kernel[(t, hkv, 2)](k, v, cache, slot_mapping, k.stride(0), k.stride(1),
                                   v.stride(0), v.stride(1), hkv, D=d,
                                   D_PAD=triton.next_power_of_2(max(d, 16)), num_warps=1)


@triton.jit
def _load_kv4_tile(row_ptrs, tok_ok, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Dequantized fp32 [BLOCK_N, D_PAD] from BLOCK_N row pointers."""
    half = tl.arange(0, D_PAD // 2)
    packed = tl.load(row_ptrs[:, None] + half[None, :],
                     mask=tok_ok[:, None] & (half[None, :] < D // 2), other=0)
    codes = unpack_uint4(packed, BLOCK_N, D_PAD).to(tl.float32)
    meta = row_ptrs + D // 2
    scale = fp16_from_bytes(tl.load(meta, mask=tok_ok, other=0), tl.load(meta + 1, mask=tok_ok, other=0))
    zero = fp16_from_bytes(tl.load(meta + 2, mask=tok_ok, other=0), tl.load(meta + 3, mask=tok_ok, other=0))
    return (codes - zero[:, None]) * scale[:, None]


@triton.jit
def _kv4_decode_kernel(q_ptr, cache_ptr, bt_ptr, ctx_ptr, out_ptr, sm_scale,
                       stride_qb, stride_qh, stride_bt, stride_ob, stride_oh, HKV,
                       D: tl.constexpr, D_PAD: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                       BS: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    ROW: tl.constexpr = D // 2 + 4
    ctx = tl.load(ctx_ptr + b)
    rg = tl.arange(0, G_PAD)
    rd = tl.arange(0, D_PAD)
    g_ok = rg < G
    d_ok = rd < D
    heads = kvh * G + rg
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + rd[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D_PAD), tl.float32)
    for start in range(0, ctx, BLOCK_N):
        tok = start + tl.arange(0, BLOCK_N)
        tok_ok = tok < ctx
        block = tl.load(bt_ptr + b * stride_bt + tok // BS, mask=tok_ok, other=0).to(tl.int64)
        k_rows = cache_ptr + (block * BS + tok % BS) * (2 * HKV * ROW) + kvh * ROW
        k = _load_kv4_tile(k_rows, tok_ok, D, D_PAD, BLOCK_N)
        v = _load_kv4_tile(k_rows + HKV * ROW, tok_ok, D, D_PAD, BLOCK_N)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + rd[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def kv4_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, sm_scale: float, block_n: int = 32) -> torch.Tensor:
    """q [B, H, D], one query per sequence, over its KV4 pages -> [B, H, D] in q's dtype."""
    b, h, d = q.shape
    _, bs, _, hkv, row = cache.shape
    if row != d // 2 + 4:
        raise ValueError(f"cache rows of {row} bytes do not hold head_dim {d}")
    if h % hkv:
        raise ValueError(f"{h} query heads do not group over {hkv} KV heads")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    g = h // hkv
    _kv4_decode_kernel[(b, hkv)](
        q, cache, block_tables, context_lens, out, sm_scale,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1), hkv,
        D=d, D_PAD=triton.next_power_of_2(max(d, 16)), G=g, G_PAD=max(triton.next_power_of_2(g), 16),
        BS=bs, BLOCK_N=block_n, num_warps=4)
    return out
