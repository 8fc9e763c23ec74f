"""The tile order both CPU GEMMs (int8_linear.c, w4a8_gemm.c) store weights in,
and the W4A8 kernel's packing of a checkpoint's codes and group parameters.

Output channels come in blocks of 16, blocks in tiles of TILE_BLOCKS; each
kernel walks a tile unit by unit (64 bytes of every block in turn), so a
tile's blocks are stored interleaved and the walk is one sequential stream,
which the hardware prefetchers follow; four streams a block apart kept a
batch-1 decode step's GEMVs far below the memory rate (docs/benchmarks.md).
"""
from __future__ import annotations

import torch

from qoqserve.kernels import qoq_ref

TILE_BLOCKS = 4  # NR in the C kernels
BLOCK_N, OCTET_K = 16, 8  # w4a8_gemm.c: output channels per block, k per 4-bit octet


def interleave_tiles(units: torch.Tensor) -> torch.Tensor:
    """[blocks, n, *unit] -> the same bytes reordered, with the same shape: per
    tile of TILE_BLOCKS blocks (the last may hold fewer), unit i of every
    block of the tile, then unit i + 1, ..."""
    blocks = units.shape[0]
    full = blocks // TILE_BLOCKS * TILE_BLOCKS
    tiles = units[:full].reshape(-1, TILE_BLOCKS, *units.shape[1:]).transpose(1, 2)
    return torch.cat([tiles.reshape(-1), units[full:].transpose(0, 1).reshape(-1)]).view(units.shape)


def repack_codes(qweight: torch.Tensor) -> torch.Tensor:
    """Checkpoint codes [N, K/2] (low nibble = even k) -> the kernel's uint8
    [ceil(N/16), ceil(K/8), 64] bytes, tiles interleaved (see w4a8_gemm.c),
    zero codes in the padding."""
    u = qoq_ref.unpack_uint4(qweight)
    n, k = u.shape
    np_, kp = -(-n // BLOCK_N) * BLOCK_N, -(-k // OCTET_K) * OCTET_K
    u = torch.nn.functional.pad(u, (0, kp - k, 0, np_ - n))
    # [block, i, octet, half, r] -> [block, octet, i, r, half]: byte 4i + r, nibble = half
    t = u.view(np_ // BLOCK_N, BLOCK_N, kp // OCTET_K, 2, 4).permute(0, 2, 1, 4, 3)
    return interleave_tiles((t[..., 0] | (t[..., 1] << 4)).reshape(np_ // BLOCK_N, kp // OCTET_K, 64))



def pack_group_params(s2: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """s2, z [N, K/g] -> uint8 [ceil(N/16), K/g, 16] bytes, tiles interleaved
    (see w4a8_gemm.c): per block and group, one byte per channel,
    (s2 - 1) << 4 | z. Refuses s2/z for which some code 0..15 makes s2*(u - z)
    leave INT8 (the in-register expansion relies on it; it also
    bounds s2 by 16, so s2 - 1 fits the nibble)."""
    s2i, zi = s2.to(torch.int32), zeros.to(torch.int32)
    if s2i.numel() and (int(s2i.min()) < 1 or int((s2i * -zi).min()) < -128
                        or int((s2i * (15 - zi)).max()) > 127):
        raise ValueError("s2*(u - z) leaves the INT8 range for some code (or s2 < 1): corrupt s2/zeros")
    n, groups = s2i.shape
    np_ = -(-n // BLOCK_N) * BLOCK_N
    byte = torch.nn.functional.pad((s2i - 1) * 16 + zi, (0, 0, 0, np_ - n))  # padding: s2 1, z 0
    return interleave_tiles(byte.view(np_ // BLOCK_N, BLOCK_N, groups).transpose(1, 2).to(torch.uint8))
