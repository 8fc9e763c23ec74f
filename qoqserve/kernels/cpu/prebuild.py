"""Build every C kernel of this package at once, on all cores, before first use.

Each kernel is otherwise built when first called, one after the other: on a
fresh 2-core machine that is most of a minute of a first `serve` or
`quantize`, and the compiler runs single-threaded. With the kernels already
cached this only checks the cache and loads the libraries."""
from __future__ import annotations

import importlib
import os
import pkgutil
from concurrent.futures import ThreadPoolExecutor

import qoqserve.kernels.cpu as cpu_kernels

# the slowest builds first, so that the pool's last build is a short one
_SLOWEST_FIRST = ("paged_prefill", "paged_decode", "w4a8_gemm", "float_linear", "elementwise")


def kernel_modules() -> list[str]:
    """The modules of qoqserve.kernels.cpu that build a library (they define load())."""
    names = [m.name for m in pkgutil.iter_modules(cpu_kernels.__path__)]
    loaders = [n for n in names if hasattr(importlib.import_module(f"{cpu_kernels.__name__}.{n}"), "load")]
    return sorted(loaders, key=lambda n: (_SLOWEST_FIRST.index(n) if n in _SLOWEST_FIRST else len(_SLOWEST_FIRST), n))


def build_all(workers: int | None = None) -> dict[str, bool]:
    """Build (or load from the cache) every kernel library, `workers` compilers
    at a time (default: one per core). Returns {module: loaded}; a kernel that
    cannot be built is logged by load_library and its caller falls back as usual."""
    mods = [importlib.import_module(f"{cpu_kernels.__name__}.{n}") for n in kernel_modules()]
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        loaded = list(pool.map(lambda m: m.load() is not None, mods))
    return {m.__name__.rsplit(".", 1)[-1]: ok for m, ok in zip(mods, loaded)}
