"""The GPU check (scripts/gpu_check.sh) as far as it runs without a GPU: the
dry run must stop at once with a clear message, and each stage's code is
exercised here on CPU (the kernel benchmark in tests/test_bench_kernels.py,
the AOT compile in tests/test_triton_aot.py)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import time
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_without_a_gpu_fails_fast_and_says_why(tmp_path):
    import sys

    env = {**os.environ, "OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    env.pop("TRITON_INTERPRET", None)
    t0 = time.monotonic()
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")], env=env,
                          capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert "no CUDA device" in proc.stdout + proc.stderr
    assert (tmp_path / "gpu_env.txt").exists()
    assert "torch" in (tmp_path / "gpu_env.txt").read_text()
    assert not (tmp_path / "gpu_kernel_tests.txt").exists()  # stopped before any later stage
    print(f"dry run stopped after {elapsed:.1f} s")


def _out(tokens, logprobs):
    return SimpleNamespace(token_ids=tokens, logprobs=logprobs)


def test_engine_smoke_comparison():
    smoke = _script("gpu_engine_smoke")
    ref = [_out([1, 2, 3], [-1.0, -2.0, -3.0])]
    assert smoke.compare(ref, [_out([1, 2, 3], [-1.0, -2.001, -3.0])], 2e-3)["ok"]
    assert not smoke.compare(ref, [_out([1, 2, 4], [-1.0, -2.0, -3.0])], 2e-3)["ok"]
    assert not smoke.compare(ref, [_out([1, 2, 3], [-1.0, -2.01, -3.0])], 2e-3)["ok"]
    # the logprob diff is taken up to the first differing token only
    r = smoke.compare(ref, [_out([1, 9, 3], [-1.0, -2.0, -99.0])], 2e-3)
    assert r["max_logprob_diff"] == 0.0 and not r["tokens_equal"]


def test_engine_smoke_runs_the_triton_path_against_the_torch_path_on_cpu(tmp_path):
    smoke = _script("gpu_engine_smoke")
    out = tmp_path / "smoke.json"
    rc = smoke.main(["--device", "cpu", "--models", "synthetic:tiny:qoq-g64", "--dtypes", "float32",
                     "--max-tokens", "3", "--num-prompts", "2", "--out", str(out)])
    import json
    rows = json.loads(out.read_text())
    assert rc == 0 and [r["mode"] for r in rows] == ["graphed", "eager"] and all(r["ok"] for r in rows), rows
    assert rows[0]["info"]["kv_kernel"] == "triton" and rows[0]["reference"]["kv_kernel"] == "torch"
    assert rows[1]["graphed_equals_eager"]["tokens_equal"] and rows[1]["info"]["captured_decode_sizes"] == []


def test_kernel_meta_keeps_views_and_reads_compiled_kernels():
    from qoqserve.bench.kernel_meta import materialize, meta_rows

    base = torch.empty(4, 10)
    view = base[:, 2:6]
    a, b, n = materialize((base, view, 7), "cpu")
    assert n == 7 and b.stride() == view.stride() and b.storage_offset() == 2
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() and not a.any()
    compiled = SimpleNamespace(n_regs=96, n_spills=0, src=SimpleNamespace(constants={(2,): 64}),
                               metadata=SimpleNamespace(shared=4096, num_warps=4, num_stages=3))
    fn = SimpleNamespace(device_caches={0: ({"key": compiled},)}, arg_names=["x", "n", "BLOCK"])
    assert meta_rows({"k": fn}) == [dict(kernel="k", n_regs=96, n_spills=0, shared=4096, num_warps=4,
                                         num_stages=3, constexprs={"BLOCK": "64"})]


FAKE_PYTHON = """#!/usr/bin/env bash
# stands in for python3 on a GPU machine: logs each call; the env probe passes,
# the GEMM bench fails, everything else succeeds
echo "$@" >> "$CALLS"
if [ "$1" = "-" ]; then cat > /dev/null; echo "torch 2.11.0 (fake)"; exit 0; fi
case "$*" in *"--only gemm"*) echo "boom"; exit 3;; esac
echo "ran $*"
"""


def test_stages_run_in_order_and_a_failing_one_does_not_stop_the_rest(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    calls = tmp_path / "calls.txt"
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": str(fake), "CALLS": str(calls)}
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr   # one stage failed
    lines = calls.read_text().splitlines()
    order = ["-", "pytest", "gpu_kernel_meta.py", "--only gemm", "--only attention", "gpu_engine_smoke.py",
             "bench throughput"]
    assert len(lines) == len(order) and all(key in line for key, line in zip(order, lines)), lines
    assert all(str(out) in line for line in lines[2:6])          # results go under $OUT
    stages = [json.loads(x) for x in (out / "gpu_check_stages.jsonl").read_text().splitlines()]
    assert [s["stage"] for s in stages] == ["tests", "meta", "gemm", "attention", "smoke", "throughput"]
    assert [s["exit"] for s in stages] == [0, 0, 3, 0, 0, 0]
    assert "boom" in (out / "bench_gemm.txt").read_text()
    assert (out / "gpu_check.md").read_text().count("\n") == 2 + 7
