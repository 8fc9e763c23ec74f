"""Paged attention: the model's attention layer over one attention backend
(layers/attention_backends.py: page format + kernels).

Prefill is the backend's where it has a kernel over the pages (the C one on
CPU: every query over the pages, its chunk's K/V written first); otherwise it
attends per sequence over [cached prefix from the pages] + [fresh K/V] in
torch SDPA. Decode is the backend's. All slots of a step
are written before any sequence reads, so two prompts of one prefill batch that
share a prefix block (one computes it, the other hits it in the prefix cache)
see the freshly written values.

A sliding-window layer (window > 0) attends each query to its last `window`
positions only, and a soft-capping one (softcap > 0, Gemma 2) replaces each
score s by softcap * tanh(s / softcap) before the softmax, on every path.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from qoqserve.kernels.cpu import dense_attention_f64
from qoqserve.layers.attention_backends import AttentionBackend, attend

if TYPE_CHECKING:
    from qoqserve.layers.page_map import PageMap


@dataclass
class AttentionMetadata:
    is_prefill: bool
    slot_mapping: torch.Tensor | None   # [T] flat slot of each new token; None = don't cache
    block_tables: torch.Tensor | None   # [B, max_blocks] (padded with 0)
    context_lens: torch.Tensor | None   # [B] tokens each sequence attends to (decode)
    # prefill only: python lists (they drive the torch path's per-sequence loop),
    # or int64 tensors where the C prefill kernel reads them (a captured step's
    # buffers); offsets count from the first prefill token, after the decodes
    query_starts: list[int] | torch.Tensor | None = None  # cumulative query offsets, len B+1
    cached_lens: list[int] | torch.Tensor | None = None   # prefix tokens already in the pages
    # a mixed step: the first num_decodes tokens are one decode each (rows
    # [:num_decodes] of block_tables, context_lens), then the prefill chunks
    # (block_tables rows after them)
    num_decodes: int = 0
    # where the sliding layers have a page pool of their own (hybrid models):
    # their slots and tables are these through it (in_window_pages)
    window_pages: PageMap | None = None

    def in_window_pages(self) -> AttentionMetadata:
        """The step as the sliding layers see it: itself, or where they have a
        page pool of their own, its slots and block tables in that pool."""
        if self.window_pages is None or self.slot_mapping is None:
            return self
        tables = self.block_tables if self.block_tables is not None else self.slot_mapping.new_zeros(0, 0)
        tables, slots = self.window_pages.map(tables, self.slot_mapping)
        return dataclasses.replace(self, slot_mapping=slots, window_pages=None,
                                   block_tables=tables if self.block_tables is not None else None)


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 backend: AttentionBackend | None, window: int | None = None, scale: float | None = None,
                 softcap: float | None = None):
        """backend: the page format and the kernels over it (None: a model that
        never runs, e.g. built on the meta device for its weight schema).
        window: the positions a query sees in a sliding-window layer (itself
        and the window - 1 before it); None: all before it. scale: the
        scores' (Gemma's query_pre_attn_scalar ** -0.5); None: head_dim ** -0.5.
        softcap: the scores' soft cap (Gemma 2's attn_logit_softcapping); None: none."""
        super().__init__()
        self.window = window or 0
        self.softcap = float(softcap or 0.0)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale or head_dim ** -0.5
        self.backend = backend
        self.layout = backend.layout if backend is not None else None

    def forward(self, q, k, v, meta: AttentionMetadata, cache: torch.Tensor | None):
        """q: [T, H, D]; k, v: [T, Hkv, D] (post-RoPE). Returns [T, H*D]."""
        if cache is not None and meta.slot_mapping is not None:
            self.backend.write(cache, k, v, meta.slot_mapping)
        if not meta.is_prefill:
            out = self._decode(q, meta, cache)
            return out.reshape(q.shape[0], self.num_heads * self.head_dim)
        d = meta.num_decodes
        out = None
        if cache is not None and meta.slot_mapping is not None:  # the chunks' K/V are in the pages
            out = self.backend.prefill(q[d:], cache, meta.block_tables[d:], meta.query_starts,
                                       meta.cached_lens if meta.cached_lens is not None
                                       else [0] * (len(meta.query_starts) - 1), self.scale, self.window,
                                       self.softcap)
        if out is None:
            qp, kp, vp = q[d:], k[d:], v[d:]
            if self.backend.quantized_prefill:
                kp, vp = self.layout.fake_quant(kp), self.layout.fake_quant(vp)
            out = self._prefill(qp, kp, vp, meta, cache)
        if d:
            dec = self.backend.decode(q[:d], cache, meta.block_tables[:d], meta.context_lens, self.scale,
                                      self.window, self.softcap)
            out = self.backend.join(dec, out)
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
                row = meta.num_decodes + i
                pk, pv = self.layout.read(cache, meta.block_tables[row:row + 1, :n_blocks], q.dtype)
                ki = torch.cat([pk[0, :cached], ki])
                vi = torch.cat([pv[0, :cached], vi])
            outs.append(self._sdpa(qi, ki, vi, cached))
        return torch.cat(outs)

    def _sdpa(self, q, k, v, offset: int):
        # fp64 on CPU (as in _decode): a prompt computed whole and one whose prefix
        # came from the cache go through different kernels and query counts; in
        # fp64 their rounding differences vanish when cast back. Where it runs, the C
        # kernel computes the same in fp64, faster than torch's SDPA (the
        # quantizer's calibration passes spend much of their time here).
        out_dtype = q.dtype
        slides = 0 < self.window < k.shape[0]  # some query here sees fewer keys than all before it
        if not slides and not self.softcap and dense_attention_f64.handles(q, k, v, offset):
            return dense_attention_f64.attention(q, k, v, offset, self.scale).to(out_dtype)
        if q.device.type == "cpu" and not q.requires_grad:  # training (quant/) needs no fp64
            q, k, v = q.double(), k.double(), v.double()
        # [L, H, D] -> [1, H, L, D]
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        mask = None
        if offset or slides:
            lq, lk = q.shape[0], k.shape[0]
            mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=offset)
            if slides:  # query i (position offset + i) sees keys offset + i - window + 1 ..
                mask &= ~torch.ones_like(mask).tril(diagonal=offset - self.window)
        o = attend(qh, kh, vh, mask, self.scale, self.softcap)
        return o[0].transpose(0, 1).to(out_dtype)

    def _decode(self, q, meta, cache):
        return self.backend.decode(q, cache, meta.block_tables, meta.context_lens, self.scale, self.window,
                                   self.softcap)
