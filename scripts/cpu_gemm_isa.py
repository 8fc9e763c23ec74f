#!/usr/bin/env python
"""The CPU GEMMs on AMX-INT8 tiles against their AVX-512 VNNI loops, side by
side in one run: the packed W4A8 kernel (kernels/cpu/w4a8_gemm.c) over one
decode step's or prefill chunk's linears of the embedded model (30 layers,
each with its own weights), and the fused INT8 kernel (int8_linear.c) as the
INT8 LM head [vocab, hidden]. Both paths give the same bits (tests); this
prints what each costs. The two paths take turns round by round, so a burst
of load from other jobs hits both; the best round of each is kept.

    python scripts/cpu_gemm_isa.py > docs/benchmarks/gemm_isa_cpu.txt
"""
import argparse
import os
import platform
import time

import torch
from cpu_w4a8_gemm import checkpoint_tensors

from qoqserve.kernels.cpu import int8_linear, w4a8_gemm
from qoqserve.layers.quantization.int8_gemm import PackedInt8Gemm
from qoqserve.model_loader import load_model_source

ISAS = ("avx512-vnni", "amx")


def best_rounds(calls: dict, repeats: int) -> dict:
    """isa -> best seconds of one round of calls[isa]() (QOQSERVE_CPU_ISA set
    to the path for the kernels that read it per call)."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats):
        for isa, call in calls.items():
            os.environ[w4a8_gemm.ISA_ENV] = isa
            start = time.perf_counter()
            call()
            best[isa] = min(best[isa], time.perf_counter() - start)
    os.environ.pop(w4a8_gemm.ISA_ENV)
    return best


def report(label: str, m: int, ops: float, best: dict) -> None:
    vnni, amx = best["avx512-vnni"], best["amx"]
    print(f"{label:>9} {m:5d}  {vnni * 1e3:9.3f}  {amx * 1e3:9.3f}  {ops / vnni / 1e12:6.2f}  "
          f"{ops / amx / 1e12:6.2f}  {vnni / amx:5.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 64, 256, 1024])
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    if w4a8_gemm.isa() != "amx":
        raise SystemExit(f"this CPU runs the packed kernel on {w4a8_gemm.isa()}, not AMX: nothing to compare")
    arch = load_model_source(None).arch
    h = arch.hidden_size
    shapes = [(h, (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim), (arch.num_heads * arch.head_dim, h),
              (h, 2 * arch.intermediate_size), (arch.intermediate_size, h)]
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"# W4A8 g64: {arch.num_layers} layers x K->N {', '.join(f'{k}->{n}' for k, n in shapes)}; "
          f"INT8 LM head {arch.vocab_size}x{h}; best of {args.repeats} rounds, paths taking turns")
    gen = torch.Generator().manual_seed(0)
    packed = {isa: [] for isa in ISAS}
    for _ in range(arch.num_layers):
        for k, n in shapes:
            t = checkpoint_tensors(n, k, 64, gen)
            for isa in ISAS:
                os.environ[w4a8_gemm.ISA_ENV] = isa  # the module reads its path once, when built
                packed[isa].append(w4a8_gemm.PackedW4A8Gemm(t["qweight"], t["s1"], t["s2"], t["zeros"], None, 64))
    os.environ.pop(w4a8_gemm.ISA_ENV)
    head_w = torch.randint(-127, 128, (arch.vocab_size, h), dtype=torch.int8, generator=gen)
    head = PackedInt8Gemm(head_w, torch.rand(arch.vocab_size, generator=gen).half() * 1e-2, None, None)
    assert int8_linear.uses_amx()
    weights = sum(k * n for k, n in shapes) * arch.num_layers
    print("#   gemm     M   vnni ms    amx ms  vnni TOPS  amx TOPS  amx x")
    for m in args.rows:
        xs = {k: torch.randn(m, k).bfloat16() for k, _ in shapes}

        def step(mods):
            for mod in mods:
                mod(xs[mod.in_features])
        best = best_rounds({isa: (lambda mods=packed[isa]: step(mods)) for isa in ISAS}, args.repeats)
        report("W4A8 x30", m, 2.0 * m * weights, best)
        x = torch.randn(m, h).bfloat16()
        best = best_rounds({isa: (lambda: head(x)) for isa in ISAS}, args.repeats)
        report("LM head", m, 2.0 * m * arch.vocab_size * h, best)


if __name__ == "__main__":
    main()
