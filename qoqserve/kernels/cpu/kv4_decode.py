"""KV4 paged decode attention on CPU (kv4_decode.c), via ctypes."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading

import torch

log = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "kv4_decode.c")
# -fassociative-math lets the dot products vectorize; no finite-math flags,
# the softmax starts from -inf
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed = False


def _build() -> str:
    from qoqserve.quant.default_checkpoint import cache_dir

    with open(_SOURCE, "rb") as f:
        tag = hashlib.sha256(f.read() + " ".join(_FLAGS).encode()).hexdigest()[:16]
    out_dir = os.path.join(cache_dir(), "kernels")
    path = os.path.join(out_dir, f"kv4_decode-{tag}.so")
    if os.path.isfile(path):
        return path
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) found")
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    subprocess.run([cc, *_FLAGS, "-o", tmp, _SOURCE, "-lm"], check=True, capture_output=True)
    os.replace(tmp, path)  # atomic: a concurrent process never loads a half-written file
    return path


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (logged once) when it cannot be built."""
    global _lib, _failed
    with _lock:
        if _lib is None and not _failed:
            try:
                lib = ctypes.CDLL(_build())
                fn = lib.kv4_decode_attention
                fn.restype = ctypes.c_int
                fn.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int] * 6 + [ctypes.c_float]
                               + [ctypes.c_int])
                _lib = lib
            except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
                _failed = True
                log.warning("CPU KV4 decode kernel unavailable (%s); using the torch path", e)
        return _lib


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
