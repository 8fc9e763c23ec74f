"""A captured CPU step: every C kernel call of one forward, recorded once and
replayed with the same arguments, as a CUDA graph replays kernel launches.

Every ctypes call of the CPU kernels goes through `launch`, every buffer
they write is made by `empty`. While a `StepGraph` records, `launch` also
appends the call (function and converted arguments: raw pointers, sizes) and
`empty` keeps the buffer alive, so replaying writes the same memory the
recorded run would have written. The recording run computes nothing: no value
a kernel writes can change which calls follow (the Python between them only
sees shapes; anything reading values is a torch op and refused), so the kernel
calls are only noted, and capturing a size costs no forward pass. Inputs are static buffers the caller fills before each
replay. A recording is only valid if *nothing else* computed data: a torch op
run once at capture would be frozen into the graph, so `StepGraph.capture`
rejects any aten op that is not a view or an allocation (CaptureError), and
the caller falls back to running op by op.

A graph for a smaller batch can share the buffers of a larger one (`shares`):
a decode step makes the same calls in the same order at every batch size, so
allocation i of the small graph fits in allocation i of the large one. Its
calls can then also be moved into one planned block (`capture(arena=...)`,
buffer_plan.py), where buffers not in use at once share memory.
"""
from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qoqserve.kernels.cpu.buffer_plan import Arena, relocate

_recording: "StepGraph | None" = None

# aten ops that only make views or fresh buffers: safe inside a capture
_ALLOWED = {"view", "_unsafe_view", "reshape", "slice", "select", "split", "split_with_sizes",
            "unsqueeze", "squeeze", "as_strided", "t", "transpose", "permute", "expand", "alias",
            "detach", "empty", "empty_like", "empty_strided", "narrow", "chunk", "unbind",
            "lift_fresh", "resolve_conj", "resolve_neg", "_reshape_alias"}


class CaptureError(RuntimeError):
    """The forward ran something a replay would not repeat."""


def launch(fn, *args):
    """Call a ctypes kernel; while a capture is on, only record the call (the
    first replay runs it and checks its result)."""
    if _recording is not None:
        _recording.ops.append((fn, args))
        return 0
    return fn(*args)


def empty(*shape, dtype: torch.dtype) -> torch.Tensor:
    """A kernel's output buffer (kept by the graph while capturing)."""
    if _recording is not None:
        return _recording.alloc(shape, dtype)
    return torch.empty(*shape, dtype=dtype)


def recording() -> bool:
    return _recording is not None


def _storages(tree) -> set[int]:
    out = set()
    for t in tree if isinstance(tree, (list, tuple)) else [tree]:
        if isinstance(t, torch.Tensor):
            out.add(t.untyped_storage().data_ptr())
        elif isinstance(t, (list, tuple)):
            out |= _storages(t)
    return out


class _OnlyViews(TorchDispatchMode):
    """Lets through views, allocations and no-ops (an op whose outputs alias
    its inputs, e.g. .to() of a tensor already of that dtype); any op that
    computes raises CaptureError."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch otherwise wraps __torch_dispatch__ in torch._dynamo.disable, whose
        # first call imports dynamo: seconds of every engine's start, for a mode
        # that never runs inside a compiled region (a capture is not compiled)
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
        out = func(*args, **(kwargs or {}))
        if name not in _ALLOWED and (name.endswith("_") or not _storages(out) <= _storages(
                list(args) + list((kwargs or {}).values()))):
            raise CaptureError(f"aten::{name} ran in the step: a replay would not repeat it")
        if _recording is not None and _recording.kept is not None:
            _recording.kept.append(out)
        return out


class StepGraph:
    def __init__(self, shares: "StepGraph | None" = None):
        self.ops: list[tuple] = []
        self.buffers: list[torch.Tensor] = []
        self.kept: list | None = None  # a list: every tensor the recording makes is kept in it
        self._shared = shares.buffers if shares is not None else []
        self.output = None
        self._plan = None

    def alloc(self, shape, dtype) -> torch.Tensor:
        i, numel = len(self.buffers), math.prod(shape)
        # past the recording guard: a fresh buffer or a view computes nothing, and
        # the guard's Python dispatch per op is most of what a recording costs
        with torch._C._DisableTorchDispatch():
            if i < len(self._shared) and self._shared[i].dtype == dtype and self._shared[i].numel() >= numel:
                t = self._shared[i].view(-1)[:numel].view(*shape)
            else:
                t = torch.empty(*shape, dtype=dtype)
        self.buffers.append(t)
        return t

    def capture(self, fn, *args, arena: Arena | None = None):
        """Trace fn(*args) once, recording its kernel calls without running
        them; returns its output buffer, which each replay writes in place.
        arena: where its intermediate buffers are placed (buffer_plan.py),
        shared with other graphs that run one at a time; its outputs stay put."""
        self.record(fn, *args)
        if arena is not None:
            self.ops = relocate(self, self.output, arena)
            self._block = arena.block  # the calls hold addresses in it
        self._freeze()
        self._native()
        return self.output

    def record(self, fn, *args):
        """Only the tracing: self.ops and self.buffers, fn's output in self.output."""
        global _recording
        if _recording is not None:
            raise CaptureError("captures do not nest")
        _recording = self
        try:
            with _OnlyViews():
                self.output = fn(*args)
        finally:
            _recording = None
        return self.output

    def _freeze(self) -> None:
        """Convert each recorded call's arguments to ctypes objects once: a
        replay repeats them unchanged, and converting Python ints per call is
        most of ctypes' ~2 us overhead for a 16-argument kernel."""
        frozen = []
        for fn, args in self.ops:
            types = getattr(fn, "argtypes", None)
            if types and len(types) == len(args):
                args = tuple(t(a) if isinstance(a, (int, float)) else a for t, a in zip(types, args))
            frozen.append((fn, args))
        self.ops = frozen

    def _native(self) -> None:
        """One native plan for every call (replay.c), where it builds and
        every call's arguments can be encoded; else replay() stays in Python."""
        # lazy: replay.py builds a C library on first use
        from qoqserve.kernels.cpu.replay import NativePlan

        try:
            self._plan = NativePlan(self.ops)
        except ValueError:
            self._plan = None

    def then(self, after: "StepGraph") -> "StepGraph":
        """This graph's calls and then `after`'s as one graph (one native plan,
        so one team region for both); its output is after's. It holds on to
        both, whose buffers its calls use."""
        g = StepGraph()
        g.ops, g.output, g._parts = self.ops + after.ops, after.output, (self, after)
        g._native()
        return g

    def replay(self, times: int = 1):
        """Every recorded call, `times` times over (a graph whose last calls
        feed its outputs back as its inputs runs that many steps)."""
        if self._plan is not None:
            self._plan.run(times)
            return self.output
        for _ in range(times):
            for fn, args in self.ops:
                if fn(*args):  # every kernel returns 0 (or nothing) on success
                    raise RuntimeError(f"CPU kernel {fn.__name__} failed during a replayed step")
        return self.output
