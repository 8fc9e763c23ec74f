"""Where a recorded step's intermediate buffers live: one arena for all.

A recording (graph.StepGraph) allocates a fresh buffer for every kernel
output of the step and keeps them all. From the calls' pointer arguments
each buffer's first and last use is known; buffers whose uses overlap get
disjoint places in one arena (largest first, first fit), the calls' pointers
are moved there, and the arena, kept from step to step, holds only the
step's peak live set. A buffer is used by a call iff the call is passed a
pointer into it, so a buffer no later call reads can be reused: the step's
outputs are read after the step and keep their places of their own.

Two things follow. An eager step recorded at thousands of rows (one_shot.py)
needs its peak live set, not the sum of its buffers (1.6 GB at a 2,048-token
step). And a captured decode step at batch 1 reuses a few cache-resident
buffers for every layer instead of writing a fresh one per layer and call,
each cold after the weights streamed through the caches (docs/runtime.md).
"""
from __future__ import annotations

import bisect

import torch

from qoqserve.kernels.cpu.replay import arg_code

_ALIGN = 64


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


def output_storages(out) -> set[int]:
    """The addresses of the storages behind a tensor or a (nested) tuple or
    list of them (None entries allowed)."""
    if isinstance(out, torch.Tensor):
        return {out.untyped_storage().data_ptr()}
    if isinstance(out, (list, tuple)):
        return set().union(*(output_storages(o) for o in out))
    return set()


def relocate(g, out, arena: Arena) -> list[tuple]:
    """The recorded calls of g (a graph.StepGraph: its ops, its buffers) with
    every pointer into one of its buffers moved into the arena (plan() above),
    except into the outputs' (a tensor or a tuple of them), which stay put.
    The calls hold raw addresses: the caller keeps `arena.block` alive as
    long as it keeps them."""
    kept = output_storages(out)
    # each buffer's own bytes, not its storage's: a graph recorded into the
    # buffers of a larger one (graph.StepGraph's `shares`) uses their first bytes
    bases = sorted({(t.data_ptr(), t.numel() * t.element_size()) for t in g.buffers
                    if t.numel() and t.untyped_storage().data_ptr() not in kept})
    starts = [s for s, _ in bases]
    first, last = [len(g.ops)] * len(bases), [-1] * len(bases)
    where = []  # per call: [(arg index, buffer, offset into it)]
    for c, (fn, args) in enumerate(g.ops):
        moved = []
        # a call with no signature (a Python stand-in): any int into a buffer is a pointer
        for a, (t, v) in enumerate(zip(getattr(fn, "argtypes", None) or [None] * len(args), args)):
            if not ((t is None or arg_code(t) == "p") and isinstance(v, int)):
                continue
            i = bisect.bisect_right(starts, v) - 1
            if i >= 0 and v < bases[i][0] + bases[i][1]:
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
