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
them, so they stay untouched virtual memory. From the calls' pointer
arguments each buffer's first and last use is known; buffers whose uses
overlap get disjoint places in one arena (largest first, first fit), the
calls' pointers are moved there, and the arena, kept from step to step,
holds only the step's peak live set. A buffer is used by a call iff the call
is passed a pointer into it, so a buffer no later call reads can be reused:
the step's output is read after the step and keeps a place of its own.
"""
from __future__ import annotations

import bisect
import logging

import torch

from qoqserve.kernels.cpu import graph
from qoqserve.kernels.cpu.replay import arg_code

log = logging.getLogger(__name__)

_ALIGN = 64

# Steps of fewer rows run op by op: there a kernel streams too little to evict
# the Python between kernels, and recording plus planning cost more than the
# gaps they remove (where the two cross: docs/runtime.md).
MIN_ROWS = 512


def plan(sizes: list[int], spans: list[tuple[int, int]]) -> tuple[list[int], int]:
    """Offsets of buffers of `sizes` bytes used over call spans (first, last),
    two buffers overlapping in memory only if their spans do not; and the
    arena's size. Largest first, each at the lowest offset that fits."""
    aligned = [-(-s // _ALIGN) * _ALIGN for s in sizes]
    offsets, placed, total = [0] * len(sizes), [], 0
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        size = aligned[i]
        busy = sorted((offsets[j], offsets[j] + aligned[j]) for j in placed
                      if spans[j][0] <= spans[i][1] and spans[i][0] <= spans[j][1])
        at = 0
        for lo, hi in busy:
            if at + size <= lo:
                break
            at = max(at, hi)
        offsets[i] = at
        placed.append(i)
        total = max(total, at + size)
    return offsets, total


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


class Arena:
    """One block of memory the planned steps place their buffers in: they run
    one at a time. It only grows; a plan keeps the block it was made for."""

    def __init__(self):
        self.block = torch.empty(0, dtype=torch.uint8)

    def at_least(self, nbytes: int) -> torch.Tensor:
        if nbytes > self.block.numel():
            self.block = torch.empty(nbytes, dtype=torch.uint8)
        return self.block


def storage_spans(tensors) -> set[tuple[int, int]]:
    """(address, bytes) of the non-empty storages behind tensors."""
    return {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors
            if t.untyped_storage().nbytes() > 0}


def relocate(g: graph.StepGraph, out: torch.Tensor, arena: Arena) -> list[tuple]:
    """g's recorded calls with every pointer into one of its buffers moved into
    the arena (plan() above), except into the output's, which stays put.
    The calls hold raw addresses: the caller keeps `arena.block` alive as
    long as it keeps them."""
    bases = sorted(storage_spans(g.buffers))
    starts = [s for s, _ in bases]
    out_base = out.untyped_storage().data_ptr()
    first, last = [len(g.ops)] * len(bases), [-1] * len(bases)
    where = []  # per call: [(arg index, buffer, offset into it)]
    for c, (fn, args) in enumerate(g.ops):
        moved = []
        for a, (t, v) in enumerate(zip(fn.argtypes, args)):
            if not (arg_code(t) == "p" and isinstance(v, int)):
                continue
            i = bisect.bisect_right(starts, v) - 1
            if i >= 0 and v < bases[i][0] + bases[i][1] and bases[i][0] != out_base:
                moved.append((a, i, v - bases[i][0]))
                first[i], last[i] = min(first[i], c), max(last[i], c)
        where.append(moved)
    used = [i for i in range(len(bases)) if last[i] >= 0]
    offsets, total = plan([bases[i][1] for i in used], [(first[i], last[i]) for i in used])
    home = dict(zip(used, (arena.at_least(total).data_ptr() + o for o in offsets)))
    ops = []
    for (fn, args), moved in zip(g.ops, where):
        if moved:
            args = list(args)
            for a, i, off in moved:
                args[a] = home[i] + off
        ops.append((fn, tuple(args)))
    return ops
