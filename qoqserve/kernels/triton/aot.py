"""Ahead-of-time compilation of every Triton kernel variant the engine can
launch, for a CUDA target, on a machine without a GPU.

The interpreter (TRITON_INTERPRET=1, the CPU tests) skips the compiler's
frontend checks and says nothing about registers or shared memory; this
runs the real compiler (the triton wheel ships ptxas and cuobjdump) for
sm_80/sm_90. Variants are found by running the real wrappers on CPU tensors
of the engine's shapes with each kernel launch replaced by a recorder, so
the signature, constexprs and specialization (divisibility by 16, do-not-
specialize) are those Triton's own launcher would derive.

Needs TRITON_INTERPRET=0 when the kernel modules are first imported.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

# dynamic shared memory one block may use, KiB (CUDA programming guide, per cc)
SHARED_LIMIT_KB = {80: 163, 86: 99, 89: 99, 90: 227}


@dataclass
class Launch:
    fn: JITFunction
    args: tuple
    kwargs: dict
    label: str
    hot: bool = True
    grid: tuple = ()


@dataclass
class Result:
    kernel: str
    label: str
    target: str
    regs: int = -1
    local_bytes: int = -1      # per thread: spills and stack (what the driver reports as n_spills*4)
    shared_bytes: int = -1
    seconds: float = 0.0
    hot: bool = True
    error: str = ""
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.error and not self.problems


class _Recorder:
    def __init__(self, fn: JITFunction, sink: list, label: list):
        self.fn, self.sink, self.label = fn, sink, label

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.sink.append(Launch(self.fn, args, kwargs, self.label[0], grid=tuple(grid)))
        return launch


@contextmanager
def recording(modules):
    """Replace each launched kernel (a JITFunction named *_kernel) of the modules
    by a recorder; yields (launches, label) where label[0] tags new launches."""
    sink, label, saved = [], [""], []
    for mod in modules:
        for name, value in list(vars(mod).items()):
            if isinstance(value, JITFunction) and name.endswith("_kernel"):
                saved.append((mod, name, value))
                setattr(mod, name, _Recorder(value, sink, label))
    if not saved:
        raise RuntimeError("no compilable kernels found: were the kernel modules imported with "
                           "TRITON_INTERPRET=1? AOT compilation needs TRITON_INTERPRET=0")
    try:
        yield sink, label
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


def _specialize(launch: Launch, backend):
    fn = launch.fn
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    return fn._pack_args(backend, launch.kwargs, bound, specialization, options)


def variant_key(launch: Launch, cc: int) -> str:
    backend = make_backend(GPUTarget("cuda", cc, 32))
    options, signature, constexprs, attrs = _specialize(launch, backend)
    return (f"{launch.fn.__name__}|{sorted(signature.items())}|{sorted(constexprs.items())}|"
            f"{sorted(attrs.items())}|{options.num_warps}|{options.num_stages}")


_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def _cubin_resources(cubin: bytes) -> tuple[int, int]:
    """(registers, local bytes per thread) from cuobjdump, which needs no driver."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                              text=True, check=True).stdout
    m = _RESOURCES.search(text)
    if not m:
        raise RuntimeError(f"unexpected cuobjdump output:\n{text}")
    return int(m.group(1)), int(m.group(2)) + int(m.group(4))


def _cause_chain(e: BaseException) -> str:
    """The error and what caused it, innermost last: a CompilationError names
    only the call site; the real reason (e.g. a NameError) is its __cause__."""
    parts = []
    while e is not None and len(parts) < 8:
        parts.append(f"{type(e).__name__}: {e}".strip())
        e = e.__cause__ or e.__context__
    return "\n".join(parts)


def compile_launch(launch: Launch, cc: int) -> Result:
    """Compile one recorded launch for sm_<cc>; never raises (errors go in the result)."""
    res = Result(launch.fn.__name__, launch.label, f"sm_{cc}", hot=launch.hot)
    t0 = time.perf_counter()
    try:
        target = GPUTarget("cuda", cc, 32)
        backend = make_backend(target)
        options, signature, constexprs, attrs = _specialize(launch, backend)
        kernel = triton.compile(ASTSource(launch.fn, signature, constexprs, attrs), target=target,
                                options=options.__dict__)
        res.shared_bytes = int(kernel.metadata.shared)
        res.regs, res.local_bytes = _cubin_resources(kernel.asm["cubin"])
    except Exception as e:  # a compile error is the finding, not a crash of the check
        res.error = _cause_chain(e)[-4000:]
    res.seconds = time.perf_counter() - t0
    if not res.error:
        limit = SHARED_LIMIT_KB.get(cc, 99) * 1024
        if res.shared_bytes > limit:
            res.problems.append(f"shared {res.shared_bytes} B > {limit} B")
        if res.hot and res.local_bytes > 0:
            res.problems.append(f"{res.local_bytes} B/thread local memory (spills)")
    return res


def unique(launches: list[Launch], cc: int) -> list[Launch]:
    seen, out = set(), []
    for launch in launches:
        key = variant_key(launch, cc)
        if key not in seen:
            seen.add(key)
            out.append(launch)
    return out


def as_dicts(results: list[Result]) -> list[dict]:
    return [{**asdict(r), "ok": r.ok} for r in results]
