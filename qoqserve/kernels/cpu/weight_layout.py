"""The tile order both CPU GEMMs (int8_linear.c, w4a8_gemm.c) store weights in.

Output channels come in blocks of 16, blocks in tiles of TILE_BLOCKS; each
kernel walks a tile unit by unit (64 bytes of every block in turn), so a
tile's blocks are stored interleaved and the walk is one sequential stream,
which the hardware prefetchers follow; four streams a block apart kept a
batch-1 decode step's GEMVs far below the memory rate (docs/benchmarks.md).
"""
from __future__ import annotations

import torch

TILE_BLOCKS = 4  # NR in the C kernels


def interleave_tiles(units: torch.Tensor) -> torch.Tensor:
    """[blocks, n, *unit] -> the same bytes reordered, with the same shape: per
    tile of TILE_BLOCKS blocks (the last may hold fewer), unit i of every
    block of the tile, then unit i + 1, ..."""
    blocks = units.shape[0]
    full = blocks // TILE_BLOCKS * TILE_BLOCKS
    tiles = units[:full].reshape(-1, TILE_BLOCKS, *units.shape[1:]).transpose(1, 2)
    return torch.cat([tiles.reshape(-1), units[full:].transpose(0, 1).reshape(-1)]).view(units.shape)
