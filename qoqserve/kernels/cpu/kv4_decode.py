"""KV4 paged decode attention on CPU (kv4_decode.c), via ctypes."""
from __future__ import annotations

import ctypes

import torch

from qoqserve.kernels.cpu.build import load_library

# -fassociative-math lets the dot products vectorize; no finite-math flags,
# the softmax starts from -inf
_FLAGS = ["-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
_SIGNATURES = {"kv4_decode_attention": (
    ctypes.c_int, [ctypes.c_void_p] * 5 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int])}


def load():
    return load_library("kv4_decode", _FLAGS, _SIGNATURES)


def available() -> bool:
    return load() is not None


def kv4_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """q [B, H, D] over KV4 pages -> [B, H, D] in q's dtype (fp32 math)."""
    lib = load()
    b, h, d = q.shape
    _, bs, _, hkv, row = cache.shape
    if row != d // 2 + 4 or h % hkv or h // hkv > 64:
        raise ValueError(f"unsupported shapes: q {tuple(q.shape)}, pages {tuple(cache.shape)}")
    qf = q.float().contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    out = torch.empty_like(qf)
    rc = lib.kv4_decode_attention(qf.data_ptr(), cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                                  out.data_ptr(), b, h, hkv, d, bs, tables.shape[1], float(sm_scale),
                                  torch.get_num_threads())
    if rc != 0:
        raise MemoryError("KV4 decode kernel could not allocate its scratch buffers")
    return out.to(q.dtype)
