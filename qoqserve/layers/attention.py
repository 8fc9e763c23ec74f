"""Paged attention in torch: the correct, portable reference path.

Prefill attends per sequence over [cached prefix from the pages] + [fresh K/V];
decode gathers each sequence's pages into a padded batch. All slots of a step
are written before any sequence reads, so two prompts of one prefill batch that
share a prefix block (one computes it, the other hits it in the prefix cache)
see the freshly written values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qoqserve.layers.kv_cache import KVCacheLayout


@dataclass
class AttentionMetadata:
    is_prefill: bool
    slot_mapping: torch.Tensor | None   # [T] flat slot of each new token; None = don't cache
    block_tables: torch.Tensor | None   # [B, max_blocks] (padded with 0)
    context_lens: torch.Tensor | None   # [B] tokens each sequence attends to (decode)
    # prefill only (python lists: they drive a per-sequence loop)
    query_starts: list[int] | None = None    # cumulative query offsets, len B+1
    cached_lens: list[int] | None = None     # prefix tokens already in the pages


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layout: KVCacheLayout):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.layout = layout
        # torch.compile'd decode_attention, set by the model runner when enabled
        self.compiled_decode = None

    def forward(self, q, k, v, meta: AttentionMetadata, cache: torch.Tensor | None):
        """q: [T, H, D]; k, v: [T, Hkv, D] (post-RoPE). Returns [T, H*D]."""
        if cache is not None and meta.slot_mapping is not None:
            self.layout.write(cache, k, v, meta.slot_mapping)
        if meta.is_prefill:
            if self.layout.quantized_prefill:
                k, v = self.layout.fake_quant(k), self.layout.fake_quant(v)
            out = self._prefill(q, k, v, meta, cache)
        else:
            out = self._decode(q, meta, cache)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _prefill(self, q, k, v, meta, cache):
        outs = []
        starts = meta.query_starts
        for i in range(len(starts) - 1):
            s, e = starts[i], starts[i + 1]
            cached = meta.cached_lens[i] if meta.cached_lens else 0
            qi, ki, vi = q[s:e], k[s:e], v[s:e]
            if cached:
                n_blocks = -(-cached // self.layout.block_size)
                pk, pv = self.layout.read(cache, meta.block_tables[i:i + 1, :n_blocks], q.dtype)
                ki = torch.cat([pk[0, :cached], ki])
                vi = torch.cat([pv[0, :cached], vi])
            outs.append(self._sdpa(qi, ki, vi, cached))
        return torch.cat(outs)

    def _sdpa(self, q, k, v, offset: int):
        # fp64 on CPU (as in _decode): a prompt computed whole and one whose prefix
        # came from the cache go through different kernels and query counts; in
        # fp64 their rounding differences vanish when cast back.
        out_dtype = q.dtype
        if q.device.type == "cpu":
            q, k, v = q.double(), k.double(), v.double()
        # [L, H, D] -> [1, H, L, D]
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        gqa = self.num_heads != self.num_kv_heads
        if offset == 0:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale,
                                               enable_gqa=gqa)
        else:
            lq, lk = q.shape[0], k.shape[0]
            mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=offset)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale,
                                               enable_gqa=gqa)
        return o[0].transpose(0, 1).to(out_dtype)

    def _decode(self, q, meta, cache):
        if self.layout.has_decode_kernel:
            return self.layout.decode_attention(q, cache, meta.block_tables, meta.context_lens,
                                                self.scale)
        if self.compiled_decode is not None:
            return self.compiled_decode(self.layout, cache, meta.block_tables, meta.context_lens, q,
                                        self.scale, self.num_heads)
        # fp64 on CPU: torch's bf16 SDPA with a mask is ~7x slower than fp32 there,
        # and the padded length (the longest sequence in the batch) changes the
        # summation order; in fp64 that difference vanishes when rounding back,
        # so a request's output does not depend on what else is in the batch.
        work = torch.float64 if q.device.type == "cpu" else q.dtype
        kc, vc = self.layout.read(cache, meta.block_tables, work)  # [B, L, Hkv, D]
        length = kc.shape[1]
        mask = torch.arange(length, device=q.device)[None, :] < meta.context_lens[:, None]
        qh = q.to(work).unsqueeze(2)             # [B, H, 1, D]
        kh, vh = kc.transpose(1, 2), vc.transpose(1, 2)  # [B, Hkv, L, D]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask[:, None, None, :],
                                           scale=self.scale,
                                           enable_gqa=self.num_heads != self.num_kv_heads)
        return o[:, :, 0, :].to(q.dtype)


def decode_attention(layout: KVCacheLayout, cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, q: torch.Tensor, scale: float,
                     num_heads: int) -> torch.Tensor:
    """One query per sequence over its paged history, in fp32, GQA by reshape.

    Written as plain tensor math so torch.compile can fuse the page gather,
    the KV4 unpacking/dequantization and both products into one loop nest
    instead of materializing the dequantized history.
    """
    k, v = layout.read(cache, block_tables, torch.float32)     # [B, L, Hkv, D]
    b, length, hkv, d = k.shape
    qg = q.float().reshape(b, hkv, num_heads // hkv, d)
    scores = torch.einsum("bkgd,blkd->bkgl", qg, k) * scale
    valid = torch.arange(length, device=q.device)[None, :] < context_lens[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.einsum("bkgl,blkd->bkgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(b, num_heads, d).to(q.dtype)
