"""A captured step's recorded kernel calls as one native plan (replay.c):
each call prepared once as a libffi call with its argument bits, the whole
step run by one ctypes call. Built with the system libffi; where it does not
build, or a call has an argument it cannot encode, graph.py replays the
calls from Python.

Consecutive calls of kernels that can run inside a team (`fn.team`, set by
build.load_library) run in one OpenMP region with a barrier between calls
instead of a fork and join per call: every thread makes a team-aware call
(kernels/cpu/team.h), thread 0 alone a serial one. The team-aware calls'
thread count (their last argument) must agree; where it does not, or it is
1, every call runs on its own as before.

A kernel whose calls stream weights from memory names them (`fn.streams`:
the call's argument values -> [(address, bytes)]); a thread waiting at the
team's barrier fetches its share of the next ones into its L2 meanwhile. A
kernel whose reads only its arguments' current values say (attention's
pages) may name a `fn.fetcher` of the same signature, which a thread waiting
shortly before the call runs once."""
from __future__ import annotations

import ctypes
import struct

from qoqserve.kernels.cpu.build import load_library

_P, _I = ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {"plan_new": (_P, [_I, _P, ctypes.c_char_p, _P, ctypes.c_char_p, ctypes.c_char_p, _I, _P]),
               "plan_run": (_I, [_P]),
               "plan_run_times": (_I, [_P, _I]),
               "plan_stream": (_I, [_P, _I, _P, ctypes.c_int64]),
               "plan_fetcher": (_I, [_P, _I, _P]),
               "plan_fetch_walk": (_I, [_P, _I, _I, ctypes.c_int64, _P, _P, _I, _P, _I]),
               "plan_free": (None, [_P])}
_CODES = {ctypes.c_void_p: "p", ctypes.c_char_p: "p", ctypes.c_int: "i", ctypes.c_int64: "l",
          ctypes.c_float: "f", ctypes.c_double: "d"}


def load():
    return load_library("replay", ["-lffi"], _SIGNATURES, fallback="a replay of the calls from Python")


def arg_code(t) -> str | None:
    """A ctypes argument type's slot code: 'p' for pointers, 'i' 'l' 'f' 'd', None for others."""
    if t in _CODES:
        return _CODES[t]
    return "p" if isinstance(t, type) and issubclass(t, ctypes._Pointer) else None


def _bits(code: str, a) -> int | None:
    """The 8-byte slot of one argument (None: not encodable)."""
    v = a.value if isinstance(a, ctypes._SimpleCData) else a
    if code == "p":
        return 0 if v is None else v if isinstance(v, int) else None
    if code in "il":
        return v & (2**32 - 1 if code == "i" else 2**64 - 1) if isinstance(v, int) else None
    if not isinstance(v, (int, float)):
        return None
    if code == "f":
        return struct.unpack("<I", struct.pack("<f", v))[0]
    return struct.unpack("<Q", struct.pack("<d", v))[0]


def team_size(threads: list[int]) -> int:
    """The team of the team-aware calls: their common thread count, or 0 (no
    team regions) when they disagree or ask for one thread."""
    sizes = set(threads)
    return sizes.pop() if len(sizes) == 1 and min(threads) > 1 else 0


class NativePlan:
    """ops: [(ctypes function, args)], as graph.StepGraph records them. The
    caller keeps ops (and what they point to) alive while the plan lives."""

    def __init__(self, ops):
        self._lib = lib = load()
        if lib is None:
            raise ValueError("replay.c does not build here (libffi)")
        fns, codes, nargs, returns, call_bits = [], [], [], [], []
        for fn, args in ops:
            types = getattr(fn, "argtypes", None)
            ret = {ctypes.c_int: "i", None: "v"}.get(getattr(fn, "restype", "?"), None)
            if types is None or len(types) != len(args) or ret is None:
                raise ValueError(f"{getattr(fn, '__name__', fn)}: no signature to replay natively")
            arg_codes = [arg_code(t) for t in types]
            arg_bits = [None if c is None else _bits(c, a) for c, a in zip(arg_codes, args)]
            if None in arg_codes or None in arg_bits:
                raise ValueError(f"{fn.__name__}: an argument replay.c cannot encode")
            fns.append(ctypes.cast(fn, ctypes.c_void_p).value)
            codes += arg_codes
            nargs.append(len(args))
            returns.append(ret)
            call_bits.append(arg_bits)
        self.names = [fn.__name__ for fn, _ in ops]
        team = [getattr(fn, "team", None) or "-" for fn, _ in ops]
        self.team_size = team_size([_bits("i", args[-1]) for (fn, args), t in zip(ops, team) if t == "t"])
        fn_arr = (ctypes.c_void_p * max(len(fns), 1))(*fns)
        n_arr = (ctypes.c_int * max(len(nargs), 1))(*nargs)
        bits = [b for arg_bits in call_bits for b in arg_bits]
        bit_arr = (ctypes.c_uint64 * max(len(bits), 1))(*bits)
        self._plan = lib.plan_new(len(fns), fn_arr, "".join(codes).encode(), n_arr, "".join(returns).encode(),
                                  "".join(team).encode(), self.team_size, bit_arr)
        if not self._plan:
            raise MemoryError("replay plan: out of memory")
        self.spans = []  # (call, address, bytes) of the weights each call streams (fn.streams)
        self.fetchers = []  # the calls with a fetcher (fn.fetcher)
        for i, ((fn, _), arg_bits) in enumerate(zip(ops, call_bits)):
            spans = getattr(fn, "streams", None)
            for ptr, nbytes in spans(arg_bits) if spans else ():
                if ptr and lib.plan_stream(self._plan, i, ptr, nbytes):
                    raise ValueError(f"{fn.__name__}: more weight spans than replay.c keeps")
                self.spans.append((i, ptr, nbytes))
            fetcher = getattr(fn, "fetcher", None)
            if fetcher is not None:
                lib.plan_fetcher(self._plan, i, ctypes.cast(fetcher, ctypes.c_void_p).value)
                self.fetchers.append(i)

    def fetched_lines(self, thread: int, threads: int, budget: int, waits: list[tuple[int, int]],
                      limit: int = 1 << 16) -> list[int]:
        """The addresses of the lines thread `thread` of `threads` fetches into
        its L2 (replay.c, `budget` bytes ahead) when it waits after each call
        `after` of waits [(after, lines)] in turn, the team meeting after at
        most `lines` there."""
        after = (ctypes.c_int * max(len(waits), 1))(*[a for a, _ in waits])
        lines = (ctypes.c_int * max(len(waits), 1))(*[w for _, w in waits])
        out = (ctypes.c_void_p * limit)()
        n = self._lib.plan_fetch_walk(self._plan, thread, threads, budget, after, lines, len(waits), out, limit)
        return [out[k] for k in range(n)]

    def run(self, times: int = 1) -> None:
        """The whole plan, `times` times in a row (one ctypes call)."""
        rc = self._lib.plan_run(self._plan) if times == 1 else self._lib.plan_run_times(self._plan, times)
        if rc:
            raise RuntimeError(f"CPU kernel {self.names[rc - 1]} failed during a replayed step")

    def __del__(self):
        plan, self._plan = getattr(self, "_plan", None), None
        if plan:
            self._lib.plan_free(plan)
