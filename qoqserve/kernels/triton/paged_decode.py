"""Paged decode attention: one query per sequence over its pages, for KV4 pages
(UINT4 codes with inline fp16 scale/zero, qoqserve.layers.kv_cache.
Int4KVCacheLayout) and, as a same-quality baseline, dense fp16 pages
(DenseKVCacheLayout).

One program per (KV head, sequence[, context split]) serves all the query
heads that share the KV head (GQA), so each page is read once. K/V tiles are
dequantized in fp32 and, for fp16/bf16 queries, fed to the tensor cores in
fp16 with fp32 accumulation (fp32 queries -- test and reference runs -- keep
exact fp32 dots, which run on the FMA units and are slow); with a single query head per KV head the scores are a
multiply-and-reduce instead of a 16-row padded dot. Online softmax in base 2
(log2(e) is folded into the query scale). Small batches split the context
over several programs (flash-decoding) and a reduce kernel merges them.
Sliding-window attention (window > 0) starts a sequence's tiles at the first
of its last `window` positions, so pages before it are never read. Logit
soft-capping (Gemma 2; SOFTCAP, cap2 the cap in log2 units) turns each score
s into cap2 tanh(s / cap2) before the softmax, by the C kernels' formula; a
variant of its own, so that models without it compile as before (with it as
a run-time branch the fp16 baseline spilled registers on sm_90).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qoqserve.kernels.triton.common import (
    fp16_from_bytes,
    fp16_pair_from_word,
    unpack_uint4,
)
from qoqserve.kernels.triton.w4a8_gemm import num_sms

LOG2E = 1.4426950408889634
BLOCK_N = 64           # tokens per tile; a first choice, to tune on a GPU
MIN_SPLIT_TOKENS = 256  # a context split shorter than this costs more to merge than it saves
MAX_SPLITS = 16


@triton.jit
def _unpack_words(words, ROWS: tl.constexpr, COLS: tl.constexpr):
    """uint32 [ROWS, COLS // 8] (8 codes per word, channel i in bits 4i..4i+3)
    -> codes [ROWS, COLS]. Built by joins whose nesting puts nibble i at i."""
    n0 = words & 0xF
    n1 = (words >> 4) & 0xF
    n2 = (words >> 8) & 0xF
    n3 = (words >> 12) & 0xF
    n4 = (words >> 16) & 0xF
    n5 = (words >> 20) & 0xF
    n6 = (words >> 24) & 0xF
    n7 = (words >> 28) & 0xF
    b0 = tl.join(tl.join(n0, n4), tl.join(n2, n6))
    b1 = tl.join(tl.join(n1, n5), tl.join(n3, n7))
    return tl.reshape(tl.join(b0, b1), (ROWS, COLS))


@triton.jit
def _load_kv4_tile(rows, tok_ok, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                   WORDS: tl.constexpr):
    """Dequantized fp32 [BLOCK_N, D_PAD] from BLOCK_N row pointers (uint8)."""
    if WORDS:
        # rows are 4-byte aligned (D % 8 == 0): codes and scale/zero as 32-bit words
        w_rows = rows.to(tl.pointer_type(tl.uint32), bitcast=True)
        cw = tl.arange(0, D_PAD // 8)
        words = tl.load(w_rows[:, None] + cw[None, :], mask=tok_ok[:, None] & (cw[None, :] < D // 8),
                        other=0)
        codes = _unpack_words(words, BLOCK_N, D_PAD).to(tl.float32)
        scale, zero = fp16_pair_from_word(tl.load(w_rows + D // 8, mask=tok_ok, other=0))
    else:
        half = tl.arange(0, D_PAD // 2)
        packed = tl.load(rows[:, None] + half[None, :], mask=tok_ok[:, None] & (half[None, :] < D // 2),
                         other=0)
        codes = unpack_uint4(packed, BLOCK_N, D_PAD).to(tl.float32)
        meta = rows + D // 2
        scale = fp16_from_bytes(tl.load(meta, mask=tok_ok, other=0), tl.load(meta + 1, mask=tok_ok, other=0))
        zero = fp16_from_bytes(tl.load(meta + 2, mask=tok_ok, other=0),
                               tl.load(meta + 3, mask=tok_ok, other=0))
    return codes * scale[:, None] - (zero * scale)[:, None]


@triton.jit(do_not_specialize=["stride_bt", "window"])
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr, ml_ptr, qk_scale,
                         stride_qb, stride_qh, stride_bt, stride_ob, stride_oh, stride_slot, stride_head,
                         splits, window, cap2,
                         D: tl.constexpr, D_PAD: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                         BS: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP16: tl.constexpr,
                         WORDS: tl.constexpr, SPLIT: tl.constexpr, F32_DOT: tl.constexpr,
                         SOFTCAP: tl.constexpr):
    # KV heads vary fastest: the programs reading one token's interleaved head
    # rows (which share DRAM sectors) run side by side
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    # the first position the query sees: window > 0 slides, else 0
    first = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(ctx - first, splits), BLOCK_N) * BLOCK_N
        lo = first + split * chunk
        hi = tl.minimum(ctx, lo + chunk)
    else:
        lo = first
        hi = ctx
    rg = tl.arange(0, G_PAD)
    rd = tl.arange(0, D_PAD)
    g_ok = rg < G
    d_ok = rd < D
    heads = kvh * G + rg
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + rd[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32) * qk_scale
    q16 = q.to(tl.float16)
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D_PAD), tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        tok = start + tl.arange(0, BLOCK_N)
        tok_ok = tok < hi
        block = tl.load(bt_row + tok // BS, mask=tok_ok, other=0).to(tl.int64)
        k_rows = k_ptr + (block * BS + tok % BS) * stride_slot + kvh * stride_head
        v_rows = v_ptr + (block * BS + tok % BS) * stride_slot + kvh * stride_head
        if KV_FP16:
            kv_mask = tok_ok[:, None] & d_ok[None, :]
            k = tl.load(k_rows[:, None] + rd[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(v_rows[:, None] + rd[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        else:
            k = _load_kv4_tile(k_rows, tok_ok, D, D_PAD, BLOCK_N, WORDS)
            v = _load_kv4_tile(v_rows, tok_ok, D, D_PAD, BLOCK_N, WORDS)
        if not F32_DOT:
            k = k.to(tl.float16)
            v = v.to(tl.float16)
        if G_PAD >= 16 and F32_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        elif G_PAD >= 16:
            s = tl.dot(q16, tl.trans(k), out_dtype=tl.float32)
        else:
            s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        if SOFTCAP:  # tanh y = (1 - e^-2|y|) / (1 + e^-2|y|), y's sign (kernels/cpu/kv_rows.h softcap_log2)
            e = tl.exp2(tl.abs(s) * (-2.8853900817779268 / cap2))
            t = cap2 * ((1.0 - e) / (1.0 + e))
            s = tl.where(s < 0, -t, t)
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if G_PAD >= 16 and F32_DOT:
            pv = tl.dot(p, v, input_precision="ieee")
        elif G_PAD >= 16:
            pv = tl.dot(p.to(tl.float16), v, out_dtype=tl.float32)
        else:
            pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    o_mask = g_ok[:, None] & d_ok[None, :]
    if not SPLIT:
        # an empty context (a padded batch slot) gives 0, not 0/0
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + rd[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        # partials [B, H, SPLITS, D_PAD] (unnormalized) and [B, H, SPLITS, 2] (m, l)
        part = (b * (G * tl.num_programs(0)) + heads).to(tl.int64) * splits + split
        tl.store(out_ptr + part[:, None] * D_PAD + rd[None, :], acc, mask=o_mask)
        tl.store(ml_ptr + part * 2, m_i, mask=g_ok)
        tl.store(ml_ptr + part * 2 + 1, l_i, mask=g_ok)


@triton.jit
def _merge_splits_kernel(part_ptr, ml_ptr, out_ptr, stride_ob, stride_oh, H, splits,
                         D: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr):
    h = tl.program_id(0)
    b = tl.program_id(1)
    rs = tl.arange(0, S_PAD)
    rd = tl.arange(0, D_PAD)
    s_ok = rs < splits
    base = (b.to(tl.int64) * H + h) * splits + rs
    m = tl.load(ml_ptr + base * 2, mask=s_ok, other=float("-inf"))
    ll = tl.load(ml_ptr + base * 2 + 1, mask=s_ok, other=0.0)
    m_all = tl.max(m, axis=0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # every split empty
    w = tl.exp2(m - m_all)
    acc = tl.load(part_ptr + base[:, None] * D_PAD + rd[None, :], mask=s_ok[:, None] & (rd < D)[None, :],
                  other=0.0)
    l_all = tl.sum(w * ll, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.maximum(l_all, 1e-30)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + rd, out.to(out_ptr.dtype.element_ty), mask=rd < D)


def num_splits(batch: int, kv_heads: int, max_tokens: int, sms: int) -> int:
    """Context splits per sequence: enough programs for about two per SM, none
    shorter than MIN_SPLIT_TOKENS. Depends on shapes only (no device sync)."""
    progs = batch * kv_heads
    if progs >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, progs), max_tokens // MIN_SPLIT_TOKENS, MAX_SPLITS))


def _check_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, b: int) -> None:
    if block_tables.dim() != 2 or block_tables.shape[0] != b or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [B={b}, n] with unit column stride, got "
                         f"{tuple(block_tables.shape)} strides {block_tables.stride()}")
    if block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables must be int32/int64, got {block_tables.dtype}")
    if context_lens.shape != (b,) or not context_lens.is_contiguous() \
            or context_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"context_lens must be a contiguous int32/int64 [B={b}], got "
                         f"{tuple(context_lens.shape)} {context_lens.dtype}")


def _decode(q, k_src, v_src, block_tables, context_lens, sm_scale, bs, hkv, stride_slot, stride_head,
            kv_fp16, words, block_n, splits, sms, window=0, softcap=0.0):
    b, h, d = q.shape
    if h % hkv:
        raise ValueError(f"{h} query heads do not group over {hkv} KV heads")
    _check_tables(block_tables, context_lens, b)
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    if b == 0:
        return out
    g = h // hkv
    d_pad = triton.next_power_of_2(max(d, 16))
    g_pad = max(triton.next_power_of_2(g), 16) if g > 1 else 1
    if splits is None:
        seen = block_tables.shape[1] * bs
        splits = num_splits(b, hkv, min(seen, window) if window > 0 else seen, sms)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be in 1..{MAX_SPLITS}, got {splits}")
    meta = dict(D=d, D_PAD=d_pad, G=g, G_PAD=g_pad, BS=bs, BLOCK_N=block_n, KV_FP16=kv_fp16,
                WORDS=words, SPLIT=splits > 1, F32_DOT=q.dtype == torch.float32, SOFTCAP=softcap > 0, num_warps=8,
                num_stages=2)
    scale, cap2 = sm_scale * LOG2E, softcap * LOG2E if softcap > 0 else 0.0
    common = (q, k_src, v_src, block_tables, context_lens)
    if splits == 1:
        _paged_decode_kernel[(hkv, b, 1)](
            *common, out, out, scale, q.stride(0), q.stride(1), block_tables.stride(0),
            out.stride(0), out.stride(1), stride_slot, stride_head, 1, window, cap2, **meta)
        return out
    part = torch.empty(b, h, splits, d_pad, dtype=torch.float32, device=q.device)
    ml = torch.empty(b, h, splits, 2, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(hkv, b, splits)](
        *common, part, ml, scale, q.stride(0), q.stride(1), block_tables.stride(0),
        0, 0, stride_slot, stride_head, splits, window, cap2, **meta)
    # the split count is a runtime argument and S_PAD fixed: one variant for every count
    _merge_splits_kernel[(h, b)](part, ml, out, out.stride(0), out.stride(1), h, splits, D=d,
                                 D_PAD=d_pad, S_PAD=MAX_SPLITS, num_warps=4)
    return out


def _sms(device: torch.device) -> int:
    return num_sms(device)


def kv4_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, sm_scale: float, window: int = 0, softcap: float = 0.0,
                         block_n: int = BLOCK_N, splits: int | None = None) -> torch.Tensor:
    """q [B, H, D], one query per sequence, over its KV4 pages
    [num_blocks, bs, 2, Hkv, D/2 + 4] (window > 0: its last `window`
    positions only; softcap > 0: scores soft-capped at it) -> [B, H, D] in q's dtype."""
    d = q.shape[-1]
    if cache.dim() != 5 or cache.dtype != torch.uint8 or not cache.is_contiguous():
        raise ValueError(f"expected a contiguous uint8 KV4 page pool, got {tuple(cache.shape)} {cache.dtype}")
    _, bs, _, hkv, row = cache.shape
    if row != d // 2 + 4:
        raise ValueError(f"cache rows of {row} bytes do not hold head_dim {d}")
    return _decode(q, cache, cache[:, :, 1], block_tables, context_lens, sm_scale, bs, hkv,
                   2 * hkv * row, row, False, d % 8 == 0, block_n, splits, _sms(q.device), window, softcap)


def fp16_paged_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                                context_lens: torch.Tensor, sm_scale: float, block_n: int = BLOCK_N,
                                splits: int | None = None) -> torch.Tensor:
    """The same kernel over dense fp16 pages [2, num_blocks, bs, Hkv, D]: the
    baseline that isolates what 4-bit pages save from how good the kernel is."""
    if cache.dim() != 5 or cache.dtype != torch.float16 or not cache.is_contiguous():
        raise ValueError(f"expected a contiguous fp16 page pool [2, nb, bs, Hkv, D], got "
                         f"{tuple(cache.shape)} {cache.dtype}")
    _, _, bs, hkv, d = cache.shape
    if d != q.shape[-1]:
        raise ValueError(f"cache head_dim {d} != query head_dim {q.shape[-1]}")
    return _decode(q, cache[0], cache[1], block_tables, context_lens, sm_scale, bs, hkv, hkv * d, d,
                   True, False, block_n, splits, _sms(q.device))
