"""GGUF's legacy block formats (Q4_0, Q4_1, Q8_0) dequantized by whole-tensor
torch ops: the gguf package does it in numpy row group by row group, which
was most of the time to load the embedded model (Q4_1). The same float32
arithmetic as the package's (one rounding per multiply and per add, in its
order), so the same bits; every other format goes to the package."""
from __future__ import annotations

import numpy as np
import torch

BLOCK = 32  # values per block in all three formats
# bytes per block: fp16 scale (Q4_1: and fp16 minimum), then the codes
_BLOCK_BYTES = {"Q4_0": 2 + 16, "Q4_1": 4 + 16, "Q8_0": 2 + 32}


def fast_formats() -> tuple[str, ...]:
    return tuple(_BLOCK_BYTES)


def _halves(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of each block, as float32 (one per block)."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _codes(codes: torch.Tensor, offset: int) -> torch.Tensor:
    """16 bytes per block -> its 32 codes minus offset, as float32: the low
    nibbles are values 0..15, the high ones 16..31."""
    out = torch.empty(codes.shape[0], BLOCK, dtype=torch.float32)
    out[:, :BLOCK // 2] = codes & 0x0F
    out[:, BLOCK // 2:] = codes >> 4
    return out.sub_(offset) if offset else out


def dequantize(raw: np.ndarray, fmt: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 tensor of `shape` that GGUF bytes `raw` of format `fmt`
    (one of fast_formats()) hold."""
    data = torch.from_numpy(np.array(raw).reshape(-1))  # a copy: the file's memmap is read-only
    size = _BLOCK_BYTES[fmt]
    if data.numel() % size:
        raise ValueError(f"{fmt}: {data.numel()} bytes are not whole blocks of {size}")
    blocks = data.view(-1, size)
    d = _halves(blocks, 0)
    if fmt == "Q8_0":
        out = blocks[:, 2:].contiguous().view(torch.int8).float().mul_(d)
    elif fmt == "Q4_0":  # (code - 8) * scale, the difference exact in float32
        out = _codes(blocks[:, 2:], 8).mul_(d)
    else:  # Q4_1: code * scale + minimum
        out = _codes(blocks[:, 4:], 0).mul_(d).add_(_halves(blocks, 2))
    return out.reshape(shape)
