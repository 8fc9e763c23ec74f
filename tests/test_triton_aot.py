"""Every Triton kernel compiled for real GPU targets (sm_80, sm_90) on this
CPU-only machine: the frontend checks the interpreter skips (plain Python
globals in jit code, dot shapes, types) and the register / local / shared
memory budget, through `qoqserve check-kernels`.

The suite compiles the representative set (`--quick`: every kernel, tile
config and group size once, ~50 variants); the CLI without --quick compiles
every variant the engine can launch. Each test runs in a subprocess because
the conftest turns the interpreter on for this process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(tmp_path) -> dict:
    # a private cache: every run compiles afresh instead of trusting an old cubin
    return {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton-cache"),
            "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _launched_kernel_names() -> set[str]:
    """Names of the kernels the wrappers launch (`*_kernel` jit functions)."""
    from qoqserve.kernels.triton import (
        act_quant,
        kv4_attention,
        paged_decode,
        w4a8_gemm,
    )

    names = set()
    for mod in (act_quant, w4a8_gemm, paged_decode, kv4_attention):
        names |= {n for n, v in vars(mod).items() if n.endswith("_kernel") and hasattr(v, "fn")}
    return names


def test_every_kernel_compiles_for_sm80_and_sm90_within_budget(tmp_path):
    out = tmp_path / "aot.json"
    proc = subprocess.run([sys.executable, "-m", "qoqserve.cli.main", "check-kernels", "--quick",
                           "--target", "sm_90", "--target", "sm_80", "--json-out", str(out)],
                          cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    results = data["results"]
    assert {r["target"] for r in results} == {"sm_80", "sm_90"}
    for target in ("sm_80", "sm_90"):
        compiled = {r["kernel"] for r in results if r["target"] == target}
        assert compiled == _launched_kernel_names(), target
    for r in results:
        assert r["ok"] and r["regs"] > 0 and r["local_bytes"] == 0, r
        assert r["shared_bytes"] <= 163 * 1024, r  # sm_80's per-block limit, the smaller one


BAD_MODULE = '''
import triton
import triton.language as tl

_MAGIC = 12582912.0        # the pattern common.py had: a plain float global


@triton.jit
def rint_global(v):
    return (v + _MAGIC) - _MAGIC


@triton.jit
def rint_literal(v):
    return (v + 12582912.0) - 12582912.0


@triton.jit
def bad_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, rint_global(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


@triton.jit
def good_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, rint_literal(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)
'''

DRIVER = '''
import sys, torch
sys.path.insert(0, sys.argv[1])
import kmod
from qoqserve.kernels.triton.aot import Launch, compile_launch
for name in ("bad_kernel", "good_kernel"):
    r = compile_launch(Launch(getattr(kmod, name), (torch.empty(64), 64), {"BLOCK": 64}, name), 90)
    print(name, "OK" if r.ok else "ERROR " + r.error.replace("\\n", " | "))
'''


def test_aot_compile_refuses_a_float_global_that_the_interpreter_accepts(tmp_path):
    (tmp_path / "kmod.py").write_text(textwrap.dedent(BAD_MODULE))
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path)], cwd=ROOT, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())
    assert lines["good_kernel"] == "OK"
    assert lines["bad_kernel"].startswith("ERROR") and "_MAGIC" in lines["bad_kernel"], lines


def test_variant_shapes_follow_the_synthetic_architectures():
    from qoqserve.kernels.triton.variants import ARCHS
    from qoqserve.model_loader.synthetic import ARCHS as SYNTHETIC

    for name, (vocab, hidden, inter, layers, heads, kv, hd, theta, tied) in SYNTHETIC.items():
        assert ARCHS[name] == (hidden, inter, heads, kv, hd), name


@pytest.mark.parametrize("text,cc", [("sm_90", 90), ("sm80", 80), ("sm_90a", 90)])
def test_targets_parse(text, cc):
    from qoqserve.cli.check_kernels import parse_target

    assert parse_target(text) == cc


KEYS = '''
import torch
from qoqserve.kernels.triton import paged_decode, w4a8_gemm
from qoqserve.kernels.triton.aot import recording, variant_key
from qoqserve.kernels.triton.variants import _e, _gemm
with recording([w4a8_gemm, paged_decode]) as (sink, label):
    for m in (2, 16):                      # one tile bucket; 16 would specialize as divisible
        _gemm(m, 4096, 4096, 128, torch.float16, False)
    for width in (17, 32):                 # block-table widths (its row stride)
        paged_decode.kv4_decode_attention(_e(64, 32, 128), _e(64 * 32, 16, 2, 8, 68, dtype=torch.uint8),
                                          _e(64, width, dtype=torch.int64), _e(64, dtype=torch.int64), 0.1)
gemm = [variant_key(l, 90) for l in sink if l.fn.__name__ == "_w4a8_gemm_kernel"]
dec = [variant_key(l, 90) for l in sink if l.fn.__name__ == "_paged_decode_kernel"]
print(len(set(gemm)), len(gemm), len(set(dec)), len(dec))
'''


def test_batch_size_and_table_width_do_not_select_new_variants(tmp_path):
    """M and the block-table stride are not specialized: serving does not
    recompile when the batch grows inside a tile bucket or tables widen."""
    proc = subprocess.run([sys.executable, "-c", KEYS], cwd=ROOT, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["1", "2", "1", "2"]
