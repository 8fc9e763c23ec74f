"""KV-cache layouts: how K/V of one layer are stored in pages.

The extension point for KV quantization. A layout answers three questions:
how many bytes one token costs (so the runner can size the page pool from a
memory budget), how fresh K/V are written into their slots, and how a batch of
paged histories is read back as dense K/V for attention. The FP layout stores
values as they are; the KV4 layout (codes + inline scale/zero) plugs in the
same way.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch


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
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def allocate(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
                           dtype=self.dtype, device=device)

    def write(self, cache, k, v, slot_mapping) -> None:
        flat = cache.view(2, -1, self.num_kv_heads, self.head_dim)
        flat[0].index_copy_(0, slot_mapping, k.to(self.dtype))
        flat[1].index_copy_(0, slot_mapping, v.to(self.dtype))

    def read(self, cache, block_tables, dtype):
        b, n = block_tables.shape
        kv = cache[:, block_tables]  # [2, B, n, bs, H, D]
        kv = kv.reshape(2, b, n * self.block_size, self.num_kv_heads, self.head_dim)
        return kv[0].to(dtype), kv[1].to(dtype)
