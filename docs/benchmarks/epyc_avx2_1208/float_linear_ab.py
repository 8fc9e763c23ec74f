#!/usr/bin/env python
"""float_linear's AVX2 path before and after cbd8335, and torch's F.linear
(oneDNN; fp32 weights only), side by side in one run: best of 7 rounds, the three taking turns
each round. Both libraries are built here from the two commits' sources with
the flags the package uses on a CPU without AVX-512; every output is checked
equal between them (the same sums, bit for bit).

    OMP_NUM_THREADS=2 python docs/benchmarks/epyc_avx2_1208/float_linear_ab.py
"""
import ctypes
import os
import subprocess
import sys
import tempfile
import time

import torch

BEFORE, AFTER = "cbd8335~1", "cbd8335"
SHAPES = [  # (M, K, N): the embedded model's linears at prompt sizes, its LM head, decode rows
    (512, 576, 1536), (512, 1536, 576), (512, 576, 49152), (64, 576, 1728), (8, 576, 1728), (1, 576, 1728)]
SOURCES = ("float_linear.c", "float_linear_avx2.h", "float_linear_avx512.h", "float_linear_dot.h",
           "float_linear_amx.h", "bf16.h", "bf16_avx512.h", "team.h", "thread_scratch.h", "lane_mask.h",
           "amx_tiles.h", "isa_cap.h")


def build(rev: str, out: str) -> ctypes.CDLL:
    src = os.path.join(out, rev.replace("~", "_"))
    os.makedirs(src)
    for name in SOURCES:
        blob = subprocess.run(["git", "show", f"{rev}:qoqserve/kernels/cpu/{name}"], capture_output=True)
        if blob.returncode == 0:
            with open(os.path.join(src, name), "wb") as f:
                f.write(blob.stdout)
    so = os.path.join(src, "fl.so")
    subprocess.run(["gcc", "-O3", "-march=x86-64", "-mtune=native", "-fopenmp", "-shared", "-fPIC",
                    "-ffp-contract=off", "-DQOQ_NO_AVX512", os.path.join(src, "float_linear.c"), "-o", so, "-lm"],
                   check=True)
    lib = ctypes.CDLL(so)
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.float_linear.restype = i32
    lib.float_linear.argtypes = [ptr, i64, i64, ptr, i32, i64, ptr, ptr, i32, i32]
    return lib


def main():
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        libs = {BEFORE: build(BEFORE, tmp), AFTER: build(AFTER, tmp)}
        print(f"# {threads} threads; GFLOP/s, best of 7 rounds; load average {os.getloadavg()[0]:.2f}")
        print(f"{'M':>4} {'K':>5} {'N':>6} {'weights':>8} {'before':>7} {'after':>7} {'torch':>7} {'after/before':>13}")
        for wdtype in (torch.float32, torch.bfloat16):
            for m, k, n in SHAPES:
                x, w = torch.randn(m, k), torch.randn(n, k).to(wdtype)
                kind = {torch.float32: 0, torch.bfloat16: 1}[wdtype]
                ys = {rev: torch.empty(m, n) for rev in libs}
                calls = {rev: (lambda lib=lib, y=ys[rev]: lib.float_linear(
                    x.data_ptr(), m, k, w.data_ptr(), kind, n, None, y.data_ptr(), 1, threads))
                    for rev, lib in libs.items()}
                if wdtype == torch.float32:  # torch has no fp32 x bf16 linear
                    calls["torch"] = lambda: torch.nn.functional.linear(x, w)
                reps = max(1, int(4e8 / (2 * m * k * n)))
                best = dict.fromkeys(calls, float("inf"))
                for _ in range(7):
                    for name, call in calls.items():
                        call()
                        t = time.perf_counter()
                        for _ in range(reps):
                            call()
                        best[name] = min(best[name], (time.perf_counter() - t) / reps)
                if not torch.equal(ys[BEFORE], ys[AFTER]):
                    sys.exit(f"{m}x{k}x{n}: the two builds differ")
                g = {name: 2 * m * k * n / s / 1e9 for name, s in best.items()}
                print(f"{m:>4} {k:>5} {n:>6} {str(wdtype)[6:]:>8} {g[BEFORE]:>7.0f} {g[AFTER]:>7.0f} "
                      f"{g.get('torch', float('nan')):>7.0f} {best[BEFORE] / best[AFTER]:>12.2f}x")
        print(f"# load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
