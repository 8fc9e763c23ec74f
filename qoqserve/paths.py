"""Where qoqserve keeps what it makes on first use (built C kernels, the
embedded model's QoQ checkpoint): $QOQSERVE_CACHE, else ~/.cache/qoqserve."""
from __future__ import annotations

import os


def cache_dir() -> str:
    return os.environ.get("QOQSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "qoqserve")
