"""Build a C file of this package into a shared library on first use (system
compiler, -march=native, cached under the qoqserve cache by source hash) and
load it with ctypes. One failure is logged once; callers fall back to torch."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading

from qoqserve.paths import cache_dir

log = logging.getLogger(__name__)

_BASE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_lock = threading.Lock()  # guards _name_locks; each library has its own, so builds can overlap
_name_locks: dict[str, threading.Lock] = {}
_libs: dict[str, ctypes.CDLL | None] = {}


def runtime_dispatch_flags() -> list[str]:
    """Flags for a library whose vector code carries its own target attributes
    and is chosen at run time: on x86 the rest is built for a baseline CPU (a
    later -march overrides -march=native), so one build runs on any x86-64."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        return ["-march=x86-64", "-mtune=native"]
    return []


def _source_text(source: str) -> bytes:
    """The file and the local headers it #includes: any edit gives a new tag."""
    with open(source, "rb") as f:
        text = f.read()
    for name in re.findall(rb'#include "([^"]+)"', text):
        text += _source_text(os.path.join(os.path.dirname(source), name.decode()))
    return text


@functools.lru_cache(maxsize=1)
def cpu_vendor_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """-DQOQ_CPU_AMD on AMD CPUs: for the few choices where AMD and Intel cores
    want different code (a prefetch hint), made when the library is built for
    this CPU (-march=native builds are per CPU anyway)."""
    try:
        with open(cpuinfo, "rb") as f:
            for line in f:
                if line.startswith(b"vendor_id"):
                    return ["-DQOQ_CPU_AMD"] if b"AuthenticAMD" in line else []
    except OSError:
        pass
    return []


@functools.lru_cache(maxsize=1)
def _cpu_identity() -> bytes:
    """What -march=native builds for: the CPU's feature flags, so that a cache
    directory shared by machines with different CPUs keeps one build each."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f:
                if line.startswith((b"flags", b"Features")):
                    return line
    except OSError:
        pass
    return platform.processor().encode()


_AVX512 = (b"avx512f", b"avx512bw", b"avx512vl", b"avx512dq")


def absent_isa_flags(identity: bytes | None = None) -> list[str]:
    """-DQOQ_NO_AVX512 on an x86 CPU without AVX-512 F/BW/VL/DQ: the attention
    kernels then leave out their AVX-512 code, which this CPU would never
    enter (a run-time check guards it) and which is most of their build time
    (a build is per CPU: _cpu_identity is part of its tag)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    words = set((identity if identity is not None else _cpu_identity()).split())
    return [] if set(_AVX512) <= words else ["-DQOQ_NO_AVX512"]


@contextlib.contextmanager
def _build_lock(path: str):
    """One process builds a library at a time (another that wants it waits,
    then finds it built): parallel test workers, or a server and a quantizer
    started together, would otherwise each compile the same file."""
    try:
        import fcntl  # lazy: POSIX only
    except ImportError:  # no POSIX locks: at worst two processes build the same file
        yield
        return
    with open(path + ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(source: str, flags: list[str]) -> str:
    all_flags = _BASE_FLAGS + absent_isa_flags() + flags
    tag = hashlib.sha256(_source_text(source) + " ".join(all_flags).encode() + _cpu_identity()).hexdigest()[:16]
    out_dir = os.path.join(cache_dir(), "kernels")
    stem = os.path.splitext(os.path.basename(source))[0]
    path = os.path.join(out_dir, f"{stem}-{tag}.so")
    if os.path.isfile(path):
        return path
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) found")
    os.makedirs(out_dir, exist_ok=True)
    with _build_lock(path):
        if not os.path.isfile(path):  # built by the process this one waited for
            _compile(cc, source, all_flags, out_dir, path)
    return path


def _compile(cc: str, source: str, all_flags: list[str], out_dir: str, path: str) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    # libraries (-l...) after the source, where the linker looks for what it needs
    compile_flags = [f for f in all_flags if not f.startswith("-l")]
    libs = [f for f in all_flags if f.startswith("-l")]
    subprocess.run([cc, *compile_flags, "-o", tmp, source, *libs, "-lm"], check=True, capture_output=True)
    os.replace(tmp, path)  # atomic: a process that does not lock never loads a half-written file


def load_library(name: str, flags: list[str], signatures: dict[str, tuple],
                 fallback: str = "the torch path", team_aware: tuple[str, ...] = (),
                 serial: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """qoqserve/kernels/cpu/<name>.c as a loaded library with the given
    {function: (restype, [argtypes])}, or None when it cannot be built here
    (logged once, naming `fallback`: what runs instead). How a replayed step
    may run each function inside its team of threads (replay.py), as
    `fn.team`: "t" for team_aware ones (built with team.h's TEAM_RUN, their
    last argument the thread count: every thread of the team calls them), "s"
    for serial ones (no OpenMP inside: one thread of the team calls them),
    None for the rest (the team ends before them)."""
    with _lock:
        name_lock = _name_locks.setdefault(name, threading.Lock())
    with name_lock:
        if name not in _libs:
            source = os.path.join(os.path.dirname(__file__), f"{name}.c")
            try:
                lib = ctypes.CDLL(_build(source, flags))
                for fn_name, (restype, argtypes) in signatures.items():
                    fn = getattr(lib, fn_name)
                    fn.restype, fn.argtypes = restype, argtypes
                    fn.team = "t" if fn_name in team_aware else "s" if fn_name in serial else None
                _libs[name] = lib
            except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
                _libs[name] = None
                log.warning("CPU kernel %s unavailable (%s); using %s", name, e, fallback)
        return _libs[name]
