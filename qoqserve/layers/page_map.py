"""Where a step's sliding layers keep their K/V when they have a page pool of
their own (engine/window_pages.py): the map from each block id of the main
pool to its page there (AttentionMetadata.in_window_pages reads a step
through it)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qoqserve.kernels.cpu import page_map as c_page_map


@dataclass
class PageMap:
    pages: torch.Tensor  # [main pool's blocks + 1] int64: block id -> page of the sliding layers' pool
    block_size: int

    def map(self, tables: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables and flat slots of the main pool, in the sliding layers' pool."""
        if slots.device.type == "cpu" and c_page_map.available():
            # one C call: a captured CPU step records it (it refuses torch ops)
            return c_page_map.page_map(self.pages, tables.contiguous(), slots.contiguous(), self.block_size)
        bs = self.block_size
        return self.pages[tables], self.pages[slots // bs] * bs + slots % bs
