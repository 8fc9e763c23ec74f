"""Triton kernels of the CUDA path (W4A8 GEMM, fused activation quantization,
KV4 paged decode attention and KV4 page writes).

Every kernel has a torch reference in qoqserve.kernels.qoq_ref and is tested
against it on CPU under TRITON_INTERPRET=1 (set before triton is imported).
"""
from __future__ import annotations

import os


def triton_available() -> bool:
    try:
        import triton  # noqa: F401  (lazy: only asks whether triton is installed)
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
