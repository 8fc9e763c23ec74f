#!/usr/bin/env python
"""The W4A8 linears of one decode step on CPU, three ways, side by side in one
run: bf16 F.linear, the fused kernel on the INT8 expansion s2*(u-z) made at
load (kernels/cpu/int8_linear.c, 1 byte/weight), and the packed kernel that
keeps the codes 4-bit and expands them in registers (kernels/cpu/w4a8_gemm.c).

Every layer gets its own weights (30 layers x qkv / o / gate_up / down of the
embedded model), so a step streams them from memory as decode does, not from
cache. Against the machine measured in the same run: read bandwidth (a
torch.sum over 512 MB) and INT8 peak (torch._int_mm at 2048x4096x4096). Bytes
are what each path keeps resident and reads per step (weights + scales).

    python scripts/cpu_w4a8_gemm.py > docs/benchmarks/w4a8_packed_cpu.txt
"""
import argparse
import platform
import time

import torch
import torch.nn.functional as F

from qoqserve.bench.timing import best_of_rounds
from qoqserve.kernels import qoq_ref
from qoqserve.kernels.cpu import w4a8_gemm
from qoqserve.layers.quantization.int8_gemm import PackedInt8Gemm
from qoqserve.model_loader import load_model_source

BATCHES = (1, 8, 32, 64)
PATHS = ("bf16", "int8", "packed", "kernel")  # kernel: the packed kernel's C call alone


def checkpoint_tensors(n: int, k: int, group: int, g: torch.Generator) -> dict:
    """Random but valid checkpoint tensors of one linear (docs/format.md)."""
    u = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    s1 = (torch.rand(n, generator=g) * 1e-2 + 1e-3).half()
    if not group:
        return {"qweight": qoq_ref.pack_uint4(u), "s1": s1, "s2": None,
                "zeros": torch.randint(0, 16, (n,), dtype=torch.uint8, generator=g), "u": u}
    s2 = torch.randint(1, 17, (n, k // group), dtype=torch.uint8, generator=g)
    # z where s2*(u - z) fits INT8 for every code (what the loader checks)
    lo, hi = (15 - 127 // s2.long()).clamp(min=0), (128 // s2.long()).clamp(max=15)
    z = torch.minimum(lo + (torch.rand(s2.shape, generator=g) * (hi - lo + 1)).long(), hi).to(torch.uint8)
    return {"qweight": qoq_ref.pack_uint4(u), "s1": s1, "s2": s2, "zeros": z, "u": u}


def int8_operand(t: dict, group: int) -> torch.Tensor:
    if not group:
        return t["u"]
    n, k = t["u"].shape
    w = t["u"].view(n, k // group, group).to(torch.int16) - t["zeros"].to(torch.int16)[..., None]
    return (w * t["s2"].to(torch.int16)[..., None]).view(n, k).to(torch.int8)


def buffer_bytes(mod) -> int:
    return sum(b.numel() * b.element_size() for b in mod.buffers())


def kernel_only(mod):
    """The packed kernel's C call alone, without the module's Python around it."""
    lib, threads = w4a8_gemm.load(), torch.get_num_threads()
    args = (mod.codes.data_ptr(), None if mod.gparams is None else mod.gparams.data_ptr(), mod.group_size,
            mod.out_features, mod.s1.data_ptr())
    rowsums = {}

    def call(x):
        m = x.shape[0]
        y = torch.empty(m, mod.out_features, dtype=x.dtype)
        rs = None if mod.zs1 is None else rowsums.setdefault(m, torch.zeros(m)).data_ptr()
        lib.w4a8_gemm(x.data_ptr(), 1, 0, None, None, 0.0, m, x.shape[1], *args, rs,
                      None if mod.zs1 is None else mod.zs1.data_ptr(), None, y.data_ptr(), 1, 0, mod.simd, threads)
        return y
    return call


def step_times(layers, m: int, repeats: int) -> dict:
    """path -> (best seconds of one step, {shape: best seconds inside a step}).
    The paths take turns round by round, so a burst of load from other jobs
    hits all of them, and the best round of each is kept."""
    xs = {k: torch.randn(m, k).bfloat16() for k in {lay["k"] for layer in layers for lay in layer.values()}}
    best = {path: (float("inf"), dict.fromkeys(layers[0], float("inf"))) for path in PATHS}
    for _ in range(repeats):
        for path in PATHS:
            acc = dict.fromkeys(layers[0], 0.0)
            start = time.perf_counter()
            for layer in layers:
                for name, lay in layer.items():
                    t0 = time.perf_counter()
                    lay[path](xs[lay["k"]])
                    acc[name] += time.perf_counter() - t0
            total = time.perf_counter() - start
            old_total, old_shapes = best[path]
            best[path] = (min(old_total, total), {s: min(old_shapes[s], acc[s]) for s in acc})
    return best


def built(make, tries: int = 3):
    """(make(), its best time of `tries`): what loading one linear costs."""
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        obj = make()
        best = min(best, time.perf_counter() - start)
    return obj, best


def machine_limits() -> tuple[float, float]:
    """(read bandwidth in B/s, INT8 peak in OP/s), measured now."""
    big = torch.ones(128 * 1024 * 1024)  # 512 MB of fp32
    bw = big.numel() * 4 / best_of_rounds(big.sum, 5, warmup=2)
    big = None
    a = torch.randint(-127, 128, (2048, 4096), dtype=torch.int8)
    b = torch.randint(-127, 128, (4096, 4096), dtype=torch.int8)
    return bw, 2 * 2048 * 4096 * 4096 / best_of_rounds(lambda: torch._int_mm(a, b), 3, warmup=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group-size", type=int, default=64, help="0 = per channel (default 64, the default checkpoint's)")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    arch = load_model_source(None).arch
    h, d, group = arch.hidden_size, arch.head_dim, args.group_size
    shapes = {"qkv_proj": (h, (arch.num_heads + 2 * arch.num_kv_heads) * d), "o_proj": (arch.num_heads * d, h),
              "gate_up_proj": (h, 2 * arch.intermediate_size), "down_proj": (arch.intermediate_size, h)}
    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}, packed kernel ISA: {w4a8_gemm.isa()}; machine shared with other jobs")
    print(f"# one decode step = {arch.num_layers} layers x {list(shapes)} (K->N: "
          f"{', '.join(f'{k}->{n}' for k, n in shapes.values())}), group size {group or 'per channel'}")

    limits = machine_limits()
    gen = torch.Generator().manual_seed(0)
    layers, t_repack, t_expand = [], 0.0, 0.0
    for _ in range(arch.num_layers):
        layer = {}
        for name, (k, n) in shapes.items():
            t = checkpoint_tensors(n, k, group, gen)
            packed, dt = built(lambda: w4a8_gemm.PackedW4A8Gemm(t["qweight"], t["s1"], t["s2"], t["zeros"],
                                                                None, group))
            t_repack += dt
            int8, dt = built(lambda: PackedInt8Gemm(int8_operand(t, group), t["s1"], None if group else t["zeros"],
                                                    None))
            t_expand += dt
            wb = torch.randn(n, k, generator=gen).bfloat16()
            nb = buffer_bytes(packed)
            layer[name] = {"k": k, "bf16": lambda x, wb=wb: F.linear(x, wb), "int8": int8, "packed": packed,
                           "kernel": kernel_only(packed),
                           "bytes": {"bf16": wb.numel() * 2, "int8": buffer_bytes(int8), "packed": nb, "kernel": nb}}
        layers.append(layer)
    params = arch.num_layers * sum(k * n for k, n in shapes.values())
    print(f"# load (best of 3 per linear): repack to the packed layout {1e3 * t_repack:.0f} ms, "
          f"INT8 expansion + VNNI repack {1e3 * t_expand:.0f} ms, for all "
          f"{arch.num_layers * len(shapes)} linears ({params / 1e6:.1f}M weights)")
    nbytes = {p: sum(lay["bytes"][p] for layer in layers for lay in layer.values()) for p in PATHS}
    print("# resident bytes per weight: " + ", ".join(f"{p} {nbytes[p] / params:.3f}" for p in nbytes))
    times = {m: step_times(layers, m, args.repeats) for m in BATCHES}
    # before and after the timings; other jobs only ever lower them, so the better one
    bw, peak = (max(u, v) for u, v in zip(limits, machine_limits()))
    print(f"# measured in this run (best of before/after the timings): read bandwidth {bw / 1e9:.1f} GB/s "
          f"(torch.sum over 512 MB); INT8 peak {peak / 1e12:.2f} TOPS (torch._int_mm 2048x4096x4096)")
    print()
    # whole step: the best round; shapes: each shape's best round, summed. Under
    # load from other jobs the second is the steadier estimate (a burst rarely
    # spans every shape of a round); rates below are from it
    print(f"{'M':>3} {'path':>7} {'step ms':>8} {'sum ms':>7} {'MB':>7} {'GB/s':>6} {'%bw':>5} {'TOPS':>6} "
          f"{'%peak':>6} {'bw-bound ms':>11} {'x bound':>7}")
    verdict = {(m, path): (times[m][path][0], sum(times[m][path][1].values())) for m in BATCHES for path in PATHS}
    per_shape_m1 = {path: times[1][path][1] for path in PATHS}
    for m in BATCHES:
        for path in PATHS:
            step, t = verdict[m, path]
            ops = 2 * m * params
            bound = nbytes[path] / bw
            print(f"{m:>3} {path:>7} {1e3 * step:>8.2f} {1e3 * t:>7.2f} {nbytes[path] / 1e6:>7.1f} "
                  f"{nbytes[path] / t / 1e9:>6.1f} {100 * nbytes[path] / t / bw:>5.0f} {ops / t / 1e12:>6.3f} "
                  f"{100 * ops / t / peak:>6.1f} {1e3 * bound:>11.2f} {t / bound:>7.2f}")
    print()
    print("# M=1 per shape (30 layers each, timed inside the step): ms, GB/s, fraction of the read bandwidth")
    for name in shapes:
        cells = []
        for path in PATHS:
            t = per_shape_m1[path][name]
            by = sum(layer[name]["bytes"][path] for layer in layers)
            cells.append(f"{path} {1e3 * t:.3f} ms {by / t / 1e9:.1f} GB/s ({100 * by / t / bw:.0f}%)")
        print(f"#   {name:>13}: " + "; ".join(cells))
    for i, what in enumerate(("whole-step best", "sum of shape bests")):
        m1 = verdict[1, "int8"][i] / verdict[1, "packed"][i]
        m32 = verdict[32, "int8"][i] / verdict[32, "packed"][i]
        ok = m1 >= 1.0 and m32 >= 1 / 1.1
        outcome = "qualifies as the default" if ok else "does NOT qualify"
        print(f"# decision rule (issue 17), {what}: packed/int8 speed {m1:.2f}x at M=1 (needs >= 1), "
              f"{m32:.2f}x at M=32 (needs >= {1 / 1.1:.2f}): packed kernel {outcome}")


if __name__ == "__main__":
    main()
