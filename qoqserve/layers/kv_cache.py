"""KV-cache layouts: how K/V of one layer are stored in pages (the storage
format only; the kernels that read and write pages are attention backends,
layers/attention_backends.py, chosen per format and device).

The extension point for KV quantization. A layout answers three questions:
how many bytes one token costs (so the runner can size the page pool from a
memory budget), how fresh K/V are written into their slots (the torch
reference of every kernel), and how a batch of paged histories is read back
as dense K/V. The FP layout stores values as they are; the KV4 layout (codes +
inline scale/zero) plugs in the same way. Row sizes come from
kv_ref.kv_row_bytes, which the C kernels read too.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from qoqserve.kernels import kv_ref, qoq_ref


class KVCacheLayout(ABC):
    name = "abstract"

    def __init__(self, num_kv_heads: int, head_dim: int, block_size: int):
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size

    @abstractmethod
    def bytes_per_token(self) -> int:
        """Bytes of K and V for one token in one layer, all heads, metadata included."""

    @abstractmethod
    def allocate(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        """The page pool of one layer."""

    @abstractmethod
    def write(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Store k, v [T, Hkv, D] at flat slots (block * block_size + offset)."""

    def fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, Hkv, D] as it reads back after a write (identity for exact layouts)."""
        return x

    @abstractmethod
    def page_rows(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [num_slots, Hkv, row] of the K rows and the V rows of a page pool."""

    @abstractmethod
    def read(self, cache: torch.Tensor, block_tables: torch.Tensor,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K, V [B, n_blocks * block_size, Hkv, D] for block tables [B, n_blocks].

        Slots past a sequence's length hold stale data; attention masks them.
        """


class DenseKVCacheLayout(KVCacheLayout):
    """K and V stored unquantized: [2, num_blocks, block_size, Hkv, D]."""

    def __init__(self, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype):
        super().__init__(num_kv_heads, head_dim, block_size)
        self.dtype = dtype
        self.name = str(dtype).replace("torch.", "")

    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * kv_ref.kv_row_bytes(self.name, self.head_dim)

    def allocate(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
                           dtype=self.dtype, device=device)

    def fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype).to(x.dtype)

    def page_rows(self, cache):
        flat = cache.view(2, -1, self.num_kv_heads, self.head_dim)
        return flat[0], flat[1]

    def write(self, cache, k, v, slot_mapping) -> None:
        k_rows, v_rows = self.page_rows(cache)
        k_rows.index_copy_(0, slot_mapping, k.to(self.dtype))
        v_rows.index_copy_(0, slot_mapping, v.to(self.dtype))

    def read(self, cache, block_tables, dtype):
        kv = cache[:, block_tables].flatten(2, 3)  # [2, B, n, bs, H, D] -> [2, B, n * bs, H, D]
        return kv[0].to(dtype), kv[1].to(dtype)


class QuantizedRowKVCacheLayout(KVCacheLayout):
    """Pages of uint8 rows [num_blocks, block_size, 2 (K, V), Hkv, row_bytes]: each
    row is one token's codes for one head followed by its own scale (and zero),
    so a page is self-contained. Subclasses say how a row is encoded."""

    row_bytes = 0

    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.row_bytes

    def allocate(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(num_blocks, self.block_size, 2, self.num_kv_heads, self.row_bytes,
                           dtype=torch.uint8, device=device)

    @abstractmethod
    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H, D] values -> [T, H, row_bytes] rows."""

    @abstractmethod
    def _decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[..., row_bytes] rows -> [..., D] values."""

    def page_rows(self, cache):
        flat = cache.view(-1, 2, self.num_kv_heads, self.row_bytes)
        return flat[:, 0], flat[:, 1]

    def write(self, cache, k, v, slot_mapping) -> None:
        flat = cache.view(-1, 2, self.num_kv_heads, self.row_bytes)
        flat.index_copy_(0, slot_mapping, torch.stack([self._encode(k), self._encode(v)], dim=1))

    def fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        return self._decode(self._encode(x), x.dtype)

    def read(self, cache, block_tables, dtype):
        # [B, n, block, 2, Hkv, row] -> [B, n * block, ...] by flatten: a view() to
        # spelled-out sizes makes torch.compile guard on a batch that equals one of them
        rows = cache[block_tables].flatten(1, 2)
        kv = self._decode(rows, dtype)
        return kv[:, :, 0], kv[:, :, 1]


class Int4KVCacheLayout(QuantizedRowKVCacheLayout):
    """QoQ KV4: per token, per head asymmetric UINT4 with fp16 scale and zero inline.

    A row is D/2 bytes of packed codes (low nibble = even channel) followed by
    the fp16 scale and the fp16 zero: x = (code - zero) * scale.
    """
    name = "int4"

    def __init__(self, num_kv_heads: int, head_dim: int, block_size: int):
        super().__init__(num_kv_heads, head_dim, block_size)
        if head_dim % 2:
            raise ValueError(f"KV4 needs an even head_dim, got {head_dim}")
        self.row_bytes = kv_ref.kv_row_bytes(self.name, head_dim)

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        codes, scale, zero = kv_ref.quantize_kv4(x)
        meta = torch.stack([scale, zero], dim=-1).view(torch.uint8)  # [T, H, 4]
        return torch.cat([kv_ref.pack_kv4(codes), meta], dim=-1)

    def _decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        d2 = self.head_dim // 2
        codes = qoq_ref.unpack_uint4(rows[..., :d2])
        meta = rows[..., d2:].contiguous().view(torch.float16)  # [..., 2]
        return kv_ref.dequantize_kv4(codes, meta[..., 0], meta[..., 1], dtype)


class Int8KVCacheLayout(QuantizedRowKVCacheLayout):
    """KV8: per token, per head symmetric INT8; a row is the D code bytes, then
    the fp16 scale: x = code * scale."""
    name = "int8"

    def __init__(self, num_kv_heads: int, head_dim: int, block_size: int):
        super().__init__(num_kv_heads, head_dim, block_size)
        self.row_bytes = kv_ref.kv_row_bytes(self.name, head_dim)

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        codes, scale = kv_ref.quantize_kv8(x)
        return torch.cat([codes.view(torch.uint8), scale[..., None].view(torch.uint8)], dim=-1)

    def _decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        d = self.head_dim
        codes = rows[..., :d].contiguous().view(torch.int8).float()
        scale = rows[..., d:].contiguous().view(torch.float16).float()  # [..., 1]
        return (codes * scale).to(dtype)
