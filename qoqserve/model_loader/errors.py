"""Errors raised while locating or reading a checkpoint."""
from __future__ import annotations


class ModelLoadError(ValueError):
    """A checkpoint (directory or file) cannot be used.

    Subclasses ValueError so callers that validate user input can catch both
    this and UnsupportedModelError with one clause. The message always names
    the offending file, because "truncated file" alone is useless when a
    sharded checkpoint has dozens of them.
    """
