"""An eager CPU step (a prefill, a mixed batch) recorded, planned into one
arena and run back to back: its kernels run with no Python between them.

A kernel that streams tens of MB evicts the caches the interpreter and
torch's dispatcher run from, so the Python between two kernels of a prefill
runs cold: ~0.3 ms a gap, ~50 ms of a 1024-token prefill that takes 8 ms
when no kernel runs (docs/benchmarks.md). Here the step's Python runs first,
warm, under graph.StepGraph's recording rules (no torch op may compute: the
recording runs no kernel), and then its calls run from a plain loop.

The recording allocates every intermediate buffer of the step at once, which
would hold them all (1.6 GB at a 2,048-token step); but it writes none of
them, so they stay untouched virtual memory, and the calls run with their
buffers placed in one arena (buffer_plan.py) that holds the step's peak
live set.
"""
from __future__ import annotations

import logging

import torch

from qoqserve.kernels.cpu import graph
from qoqserve.kernels.cpu.buffer_plan import Arena, relocate

log = logging.getLogger(__name__)

# Steps of fewer rows run op by op: there a kernel streams too little to evict
# the Python between kernels, and recording plus planning cost more than the
# gaps they remove (where the two cross: docs/runtime.md).
MIN_ROWS = 512


class OneShotSteps:
    """Runs fn(*args) as above. Steps come in kinds (the caller's key: a
    prefill alone, or prefills mixed with decodes, take different paths);
    `disabled[kind]` says why a kind could not be recorded: that step ran op
    by op, as every later step of its kind does. A step of fewer than
    `min_rows` rows (the caller's count) runs op by op too."""

    def __init__(self, min_rows: int = MIN_ROWS):
        self.disabled: dict = {}
        self.min_rows = min_rows
        self.arena = Arena()

    @property
    def arena_bytes(self) -> int:
        return self.arena.block.numel()

    def __call__(self, fn, *args, kind=None, rows: int | None = None):
        if kind in self.disabled or graph.recording() or (rows is not None and rows < self.min_rows):
            return fn(*args)
        g = graph.StepGraph()
        g.kept = []
        try:
            out = g.record(fn, *args)
        except graph.CaptureError as e:
            self.disabled[kind] = str(e)
            log.info("eager steps (%s) run op by op: %s", kind, e)
            return fn(*args)
        except (RuntimeError, MemoryError):
            # e.g. no address space for every buffer at once (strict overcommit):
            # the recording ran nothing, so this step runs op by op (and a real
            # error in the forward raises there)
            del g
            return fn(*args)
        return self._run(g, out)

    def _run(self, g: graph.StepGraph, out: torch.Tensor) -> torch.Tensor:
        for fn, args in relocate(g, out, self.arena):
            if fn(*args):  # every kernel returns 0 (or nothing) on success
                raise RuntimeError(f"CPU kernel {fn.__name__} failed in an eager step")
        return out
