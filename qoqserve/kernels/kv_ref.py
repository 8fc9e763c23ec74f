"""Torch reference of the KV cache's page formats: per token, per head
UINT4 (KV4, asymmetric) and INT8 (KV8, symmetric), and each format's row size.

The torch cache (layers/kv_cache.py), the C and Triton kernels and the
quantizer's calibration statistics all quantize K and V with these numerics.
"""
from __future__ import annotations

import torch

from qoqserve.kernels.qoq_ref import FP16_TINY, pack_uint4

# --------------------------------------------------------------------- KV4
# bytes of one page row (one token's K or V of one head) per KV page format: the
# torch layouts (layers/kv_cache.py) and the C/Triton kernels read this one table
_KV_ROW_BYTES = {"int4": lambda d: d // 2 + 4,   # packed codes, fp16 scale, fp16 zero
                 "int8": lambda d: d + 2,        # int8 codes, fp16 scale
                 "float16": lambda d: 2 * d, "bfloat16": lambda d: 2 * d, "float32": lambda d: 4 * d}
KV_FORMATS = tuple(_KV_ROW_BYTES)


def kv_row_bytes(fmt: str, head_dim: int) -> int:
    if fmt not in _KV_ROW_BYTES:
        raise ValueError(f"unknown KV page format {fmt!r}; choose from {', '.join(KV_FORMATS)}")
    return _KV_ROW_BYTES[fmt](head_dim)


def quantize_kv4(x: torch.Tensor):
    """Per token, per head asymmetric UINT4 over the last dim of x [T, H, D].

    Returns (codes uint8 [T,H,D], scale fp16 [T,H], zero fp16 [T,H]). The scale
    floor amax*2^-14 keeps |zero| <= 2^14 representable in fp16 for near-constant
    heads; it only bites below the fp16 resolution of the values themselves.
    """
    xf = x.float()
    lo, hi = xf.amin(dim=-1), xf.amax(dim=-1)
    amax = torch.maximum(lo.abs(), hi.abs())
    scale = torch.maximum((hi - lo) / 15, amax * 2.0**-14).half()
    scale = torch.where(scale > 0, scale, torch.full_like(scale, FP16_TINY))
    zero = (-lo / scale.float()).half()
    codes = torch.round(xf / scale.float()[..., None] + zero.float()[..., None])
    return codes.clamp(0, 15).to(torch.uint8), scale, zero


def dequantize_kv4(codes, scale, zero, dtype=torch.float16) -> torch.Tensor:
    deq = (codes.float() - zero.float()[..., None]) * scale.float()[..., None]
    return deq.to(dtype)


def pack_kv4(codes: torch.Tensor) -> torch.Tensor:
    """[T, H, D] codes -> [T, H, D//2] bytes (same nibble order as weights)."""
    return pack_uint4(codes)


# --------------------------------------------------------------------- KV8
def quantize_kv8(x: torch.Tensor):
    """Per token, per head symmetric INT8 over the last dim of x [T, H, D]:
    (codes int8 [T,H,D], scale fp16 [T,H]); x ~= code * scale."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = (amax / 127).half()
    scale = torch.where(scale > 0, scale, torch.full_like(scale, FP16_TINY))
    codes = torch.clamp(torch.round(xf / scale.float()[..., None]), -127, 127)
    return codes.to(torch.int8), scale
