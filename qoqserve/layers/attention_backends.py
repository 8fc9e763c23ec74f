"""Attention backends: the kernels that write K/V into pages and attend a
decode step over them, apart from the page formats they read
(layers/kv_cache.py). The engine picks one per (format, device)
(engine/backends.py); each exposes the same two operations.

* `AttentionBackend` itself: the portable torch reference: the layout's own
  write, decode by gathering each sequence's pages into a padded batch (fp64
  SDPA on CPU), or with `compiled=True` a torch.compile'd gather + dequantize
  + attend;
* `CpuAttention`: our C kernels (kernels/cpu/): one paged-decode and one
  paged-prefill kernel for every page format, and the page writes;
* `TritonAttention`: the CUDA path for KV4 pages (kernels/triton/).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from qoqserve.kernels.cpu import elementwise, kv4_write, paged_decode, paged_prefill
from qoqserve.layers.kv_cache import (
    DenseKVCacheLayout,
    Int4KVCacheLayout,
    KVCacheLayout,
)
from qoqserve.layers.token_ops import soft_cap


@contextlib.contextmanager
def _no_duck_sizing():
    """While the compiled decode traces: a batch that happens to equal another
    size (the K/V pair, the heads, the pages per sequence) would otherwise be
    compiled as that size, and every other batch recompiled. Set and restored
    by hand: the config module's patch() costs several times as much, and this
    runs per layer and step."""
    config = torch.fx.experimental._config
    before, config.use_duck_shape = config.use_duck_shape, False
    try:
        yield
    finally:
        config.use_duck_shape = before


class AttentionBackend:
    """A page format plus the kernels over it. The torch reference: the
    layout's write; decode by gathering each sequence's pages into a padded
    batch (fp64 SDPA on CPU) or, compiled, by decode_attention below."""
    name = "torch"

    def __init__(self, layout: KVCacheLayout, quantized_prefill: bool | None = None,
                 compiled: bool = False):
        """quantized_prefill None: whenever the pages are lossy (not dense)."""
        self.layout = layout
        # Whether prefill attends to K/V as stored rather than as computed. QServe
        # attends to the fresh values; we default to the stored ones whenever the
        # store is lossy, because a prompt whose prefix comes from the prefix cache
        # can only see stored values: otherwise its output would depend on what
        # ran before it. It is also exactly what the fake-quant simulation measures.
        self.quantized_prefill = (not isinstance(layout, DenseKVCacheLayout)
                                  if quantized_prefill is None else quantized_prefill)
        self._compiled = None
        if compiled:
            # every (layout, dtype, batch==1) combination is its own graph; several
            # engines in one process (benchmarks) exceed dynamo's default limit of 8
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self._compiled = torch.compile(decode_attention, dynamic=True)

    def write(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        self.layout.write(cache, k, v, slot_mapping)

    def prefill(self, q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                query_starts: list[int], first_positions: list[int], scale: float,
                window: int = 0, softcap: float = 0.0) -> torch.Tensor | None:
        """q [T, H, D]: prompt chunks back to back (sequence i: rows
        query_starts[i]:query_starts[i+1], the first at position
        first_positions[i]), causal over their pages (window > 0: over the
        last `window` positions only; softcap > 0: scores soft-capped), the
        chunks' own K/V written first -> [T, H, D]. None: no kernel over the
        pages here (the attention layer then attends the fresh values in torch)."""
        return None

    def join(self, decodes: torch.Tensor, prefills: torch.Tensor) -> torch.Tensor:
        """A mixed step's attention outputs, its decodes' rows first."""
        return torch.cat([decodes, prefills])

    def decode(self, q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """q [B, H, D], one query per sequence over its pages (window > 0:
        over its last `window` positions; softcap > 0: scores soft-capped) -> [B, H, D]."""
        if self._compiled is not None:
            with _no_duck_sizing():
                return self._compiled(self.layout, cache, block_tables, context_lens, q, scale, q.shape[1],
                                      window, softcap)
        # fp64 on CPU: torch's bf16 SDPA with a mask is ~7x slower than fp32 there,
        # and the padded length (the longest sequence in the batch) changes the
        # summation order; in fp64 that difference vanishes when rounding back,
        # so a request's output does not depend on what else is in the batch.
        work = torch.float64 if q.device.type == "cpu" else q.dtype
        kc, vc = self.layout.read(cache, block_tables, work)  # [B, L, Hkv, D]
        mask = seen_positions(kc.shape[1], context_lens, window)
        qh = q.to(work).unsqueeze(2)             # [B, H, 1, D]
        kh, vh = kc.transpose(1, 2), vc.transpose(1, 2)  # [B, Hkv, L, D]
        o = attend(qh, kh, vh, mask[:, None, None, :], scale, softcap)
        return o[:, :, 0, :].to(q.dtype)


class CpuAttention(AttentionBackend):
    """Decode by paged_decode.c, which converts each page row once per token
    instead of materializing the history; the same kernel for every format."""
    name = "c"

    @staticmethod
    def supports(layout: KVCacheLayout) -> bool:
        if not paged_decode.available():
            return False
        return not isinstance(layout, DenseKVCacheLayout) or paged_decode.supports_dtype(layout.dtype)

    def __init__(self, layout: KVCacheLayout, quantized_prefill: bool | None = None):
        super().__init__(layout, quantized_prefill)
        # decided once: a captured step must not probe the library per call
        self._c_write = isinstance(layout, Int4KVCacheLayout) and kv4_write.available()
        self._c_copy = isinstance(layout, DenseKVCacheLayout) and kv4_write.available()
        self._c_prefill = paged_prefill.available()
        self._c_join = elementwise.available()

    def write(self, cache, k, v, slot_mapping) -> None:
        if self._c_write:
            kv4_write.kv4_write(cache, k, v, slot_mapping)
        elif self._c_copy and k.dtype == self.layout.dtype and k.is_contiguous() and v.is_contiguous():
            kv4_write.dense_write(*self.layout.page_rows(cache), k, v, slot_mapping)
        else:
            self.layout.write(cache, k, v, slot_mapping)

    def prefill(self, q, cache, block_tables, query_starts, first_positions, scale, window=0, softcap=0.0):
        # the pages must hold what prefill attends to: the stored values when
        # those are what it sees (quantized_prefill), else the exact ones
        exact = isinstance(self.layout, DenseKVCacheLayout) and self.layout.dtype == q.dtype
        if not self._c_prefill or not (self.quantized_prefill or exact):
            return None
        k_rows, v_rows = self.layout.page_rows(cache)
        return paged_prefill.paged_prefill_attention(q, k_rows, v_rows, self.layout.name, self.layout.block_size,
                                                     block_tables, query_starts, first_positions, scale, window,
                                                     softcap)

    def join(self, decodes, prefills):
        if (self._c_join and decodes.dtype == prefills.dtype and decodes.is_contiguous()
                and prefills.is_contiguous()):
            return elementwise.concat_rows(decodes, prefills)  # one C call: a one-shot step records it
        return super().join(decodes, prefills)

    def decode(self, q, cache, block_tables, context_lens, scale, window=0, softcap=0.0):
        k_rows, v_rows = self.layout.page_rows(cache)
        return paged_decode.paged_decode_attention(q, k_rows, v_rows, self.layout.name,
                                                   self.layout.block_size, block_tables,
                                                   context_lens, scale, window, softcap)


class TritonAttention(AttentionBackend):
    """KV4 pages written and read by the Triton kernels (the CUDA path)."""
    name = "triton"

    @staticmethod
    def supports(layout: KVCacheLayout) -> bool:
        return isinstance(layout, Int4KVCacheLayout)

    def write(self, cache, k, v, slot_mapping) -> None:
        # lazy: Triton (imports triton, present only with it)
        from qoqserve.kernels.triton.ops import kv4_write
        kv4_write(cache, k, v, slot_mapping)

    def decode(self, q, cache, block_tables, context_lens, scale, window=0, softcap=0.0):
        # lazy: Triton (imports triton, present only with it)
        from qoqserve.kernels.triton.ops import kv4_decode_attention
        return kv4_decode_attention(q, cache, block_tables, context_lens, scale, window, softcap)


def seen_positions(length: int, context_lens: torch.Tensor, window: int = 0) -> torch.Tensor:
    """[B, length] bool: the positions each sequence's query attends to, its
    context (window > 0: the last `window` positions of it)."""
    pos = torch.arange(length, device=context_lens.device)[None, :]
    seen = pos < context_lens[:, None]
    return seen & (pos >= context_lens[:, None] - window) if window > 0 else seen


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float = 0.0) -> torch.Tensor:
    """Attention of q [B, H, Lq, D] over k, v [B, Hkv, Lk, D] (GQA: H a
    multiple of Hkv) where mask (bool, broadcast to [B, H, Lq, Lk]) allows;
    None: causal, the queries the last Lq positions. softcap > 0: each score
    s soft-capped to softcap * tanh(s / softcap) (Gemma 2), in the order
    transformers computes it, which SDPA cannot; a row that sees nothing
    gives zeros then."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = soft_cap(q @ k.transpose(-1, -2) * scale, softcap)
    if mask is None:
        lq, lk = q.shape[2], k.shape[2]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
    return weights @ v


def decode_attention(layout: KVCacheLayout, cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, q: torch.Tensor, scale: float,
                     num_heads: int, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """One query per sequence over its paged history, in fp32, GQA by reshape.

    Written as plain tensor math so torch.compile can fuse the page gather,
    the KV4 unpacking/dequantization and both products into one loop nest
    instead of materializing the dequantized history.
    """
    k, v = layout.read(cache, block_tables, torch.float32)     # [B, L, Hkv, D]
    b, length, hkv, d = k.shape
    qg = q.float().reshape(b, hkv, num_heads // hkv, d)
    scores = torch.einsum("bkgd,blkd->bkgl", qg, k) * scale
    if softcap:
        scores = soft_cap(scores, softcap)
    valid = seen_positions(length, context_lens, window)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.einsum("bkgl,blkd->bkgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(b, num_heads, d).to(q.dtype)
