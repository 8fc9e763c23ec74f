#!/usr/bin/env python
"""A roofline table of the CPU kernels at the shapes of one decode step of
the embedded model (batch 1 and batch 32, 1024-token contexts) and of a
1024-token prefill, against this machine's limits measured in the same run:
read bandwidth (torch.sum over 512 MB), INT8 peak (torch._int_mm at
2048x4096x4096, or the issue rate of vpdpbusd if higher), fp32 peak
(torch.mm at 2048^3, or the issue rate of vfmadd) and, for a bf16 model's
linears on CPUs with AVX512-BF16, bf16 peak (torch's bf16 mm at 2048^3, or
the issue rate of vdpbf16ps).

Per kernel call: time (the fastest of --repeats single calls), the bytes it must move (weights, pages,
activations in and out), the operations it must do, achieved GB/s and
GOP/s, and each as a fraction of the matching limit. A kernel is near its
roof when one fraction is near 1; far from both, it is overhead-bound or
unfinished. Calls go through the Python wrappers the eager path uses.
Weights are 30 copies (one per layer) taken in turn, so they stream from
memory as in a step, not from cache.

    OMP_NUM_THREADS=2 python scripts/cpu_roofline.py > docs/benchmarks/roofline_cpu.md
"""
import argparse
import platform
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from cpu_w4a8_gemm import checkpoint_tensors  # noqa: E402

from qoqserve.bench.timing import fastest_call, read_bandwidth  # noqa: E402
from qoqserve.kernels.cpu import elementwise, float_linear, kv4_write, w4a8_gemm  # noqa: E402
from qoqserve.layers import kv_cache as kc  # noqa: E402
from qoqserve.layers.attention_backends import CpuAttention  # noqa: E402
from qoqserve.layers.logits import Int8LogitsHead  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, LAYERS = 576, 9, 3, 64, 1536, 49152, 30
LINEARS = {"qkv_proj": (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), "o_proj": (HIDDEN, HIDDEN),
           "gate_up_proj": (HIDDEN, 2 * INTER), "down_proj": (INTER, HIDDEN)}


def cycling(calls):
    """One call of the next copy each time: weights come from memory, not cache."""
    state = {"i": 0}

    def run():
        calls[state["i"] % len(calls)]()
        state["i"] += 1
    return run


def w4a8_rows(m: int, g: torch.Generator):
    for name, (k, n) in LINEARS.items():
        # gate_up as the engine runs it: SiLU*mul in its epilogue, [m, n/2] out
        pairs = name == "gate_up_proj" and w4a8_gemm.silu_pairs_supported(n, 64)
        mods = []
        for _ in range(LAYERS):
            t = checkpoint_tensors(n, k, 64, g)
            mods.append(w4a8_gemm.PackedW4A8Gemm(t["qweight"], t["s1"], t["s2"], t["zeros"], None, 64,
                                                 silu_pairs=pairs))
        x = torch.randn(m, k)
        weight = sum(b.numel() * b.element_size() for b in mods[0].buffers())
        calls = [lambda mod=mod, x=x, pairs=pairs: mod.silu_mul(x) if pairs else mod(x) for mod in mods]
        yield (f"W4A8 GEMM {name} {n}x{k} (packed g64{', SiLU*mul epilogue' if pairs else ''})", m,
               cycling(calls), weight + 4 * m * (k + (n // 2 if pairs else n)), 2 * m * n * k, "int8")


def lm_head_rows(m: int, g: torch.Generator):
    w = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.05).bfloat16()
    x = torch.randn(m, HIDDEN)
    yield ("LM head, bf16 weights (float_linear.c)", m, lambda: float_linear.float_linear(x, w),
           w.numel() * 2 + 4 * m * (HIDDEN + VOCAB), 2 * m * VOCAB * HIDDEN, "fp32")
    head = Int8LogitsHead(fused=True, cpu_ops=True)
    head.prepare(w.float())
    yield ("LM head, INT8 weights (--lm-head-dtype int8)", m, lambda: head(x, w),
           head.resident_bytes() + 4 * m * (HIDDEN + VOCAB), 2 * m * VOCAB * HIDDEN, "int8")


def attention_rows(b: int, ctx: int):
    for fmt, layout in (("KV4", kc.Int4KVCacheLayout(KV_HEADS, HEAD_DIM, 16)),
                        ("bf16", kc.DenseKVCacheLayout(KV_HEADS, HEAD_DIM, 16, torch.bfloat16))):
        pages = b * ctx // 16
        cache = layout.allocate(pages + 1, "cpu")
        slots = torch.arange(pages * 16)
        layout.write(cache, torch.randn(pages * 16, KV_HEADS, HEAD_DIM), torch.randn(pages * 16, KV_HEADS, HEAD_DIM),
                     slots)
        attn = CpuAttention(layout, quantized_prefill=True)  # prefill reads the pages as stored
        tables = torch.arange(pages).view(b, ctx // 16)
        kv_bytes = 2 * b * ctx * layout.bytes_per_token()
        q = torch.randn(b, HEADS, HEAD_DIM)
        lens = torch.full((b,), ctx)
        yield (f"paged decode attention, {fmt} pages, ctx {ctx}", b,
               lambda attn=attn, cache=cache, tables=tables, q=q: attn.decode(q, cache, tables, lens, 0.125),
               kv_bytes // 2 + 8 * b * HEADS * HEAD_DIM, 4 * b * ctx * HEADS * HEAD_DIM, "fp32")
        if b == 1:
            qp = torch.randn(ctx, HEADS, HEAD_DIM)
            yield (f"paged prefill attention, {fmt} pages, {ctx} tokens", ctx,
                   lambda attn=attn, cache=cache, tables=tables, qp=qp:
                   attn.prefill(qp, cache, tables, [0, ctx], [0], 0.125),
                   kv_bytes // 2 + 8 * ctx * HEADS * HEAD_DIM, 4 * (ctx * (ctx + 1) // 2) * HEADS * HEAD_DIM, "fp32")


def bf16_rows(m: int, g: torch.Generator):
    """A bf16 model's linears (float_linear.c: the dot-product path where the
    CPU has AVX512-BF16), bf16 rows and outputs."""
    for name, (k, n) in LINEARS.items():
        ws = [torch.randn(n, k, generator=g).bfloat16() for _ in range(LAYERS)]
        x = torch.randn(m, k, generator=g).bfloat16()
        yield (f"bf16 linear {name} {n}x{k} (float_linear.c, {float_linear.path()})", m,
               cycling([lambda w=w, x=x: float_linear.float_linear(x, w, out_dtype=torch.bfloat16) for w in ws]),
               2 * (n * k + m * (k + n)), 2 * m * n * k, "bf16")


def elementwise_rows(m: int):
    h, d, w = torch.randn(m, HIDDEN), torch.randn(m, HIDDEN), torch.ones(HIDDEN)
    yield ("add + RMSNorm (elementwise.c)", m, lambda: elementwise.add_rms_norm(h, d, w, 1e-5),
           4 * m * HIDDEN * 4, 5 * m * HIDDEN, "fp32")
    gu = torch.randn(m, 2 * INTER)
    yield ("SiLU * up (elementwise.c)", m, lambda: elementwise.silu_mul(gu), 4 * m * 3 * INTER, 20 * m * INTER, "fp32")
    # the step's per-token ops around attention: RoPE + the QoQ key transform, the KV4 page write
    qkv_width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv, pos = torch.randn(m, qkv_width), torch.randint(0, 4096, (m,))
    cos, sin = torch.randn(4096, HEAD_DIM), torch.randn(4096, HEAD_DIM)
    rot, shift = torch.linalg.qr(torch.randn(HEAD_DIM, HEAD_DIM))[0].contiguous(), torch.randn(KV_HEADS, HEAD_DIM)
    yield ("q/k/v + RoPE + key transform (elementwise.c)", m,
           lambda: elementwise.qkv_rope(qkv, pos, cos, sin, HEADS, KV_HEADS, HEAD_DIM, shift, rot),
           4 * m * 2 * qkv_width, 2 * m * (HEADS + KV_HEADS) * HEAD_DIM * HEAD_DIM, "fp32")
    layout = kc.Int4KVCacheLayout(KV_HEADS, HEAD_DIM, 16)
    cache, kv = layout.allocate(-(-m // 16) + 1, "cpu"), torch.randn(m, KV_HEADS, HEAD_DIM)
    slots = torch.arange(m)
    yield ("KV4 page write (kv4_write.c)", m, lambda: kv4_write.kv4_write(cache, kv, kv, slots),
           2 * m * KV_HEADS * (4 * HEAD_DIM + HEAD_DIM // 2 + 4), 2 * m * KV_HEADS * HEAD_DIM * 4, "fp32")


# Twelve independent chains of one instruction each: the issue rate the
# kernels' inner loops are made of (vpdpbusd for INT8, vfmadd for fp32).
PEAK_PROBE = r"""
#include <immintrin.h>
#include <omp.h>
#define CHAINS(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11)
__attribute__((target("avx512f,avx512bw,avx512vnni"))) double vnni_ops(long iters, int threads) {
    double t = omp_get_wtime();
    #pragma omp parallel num_threads(threads)
    {
#define DECL(i) __m512i a##i = _mm512_set1_epi32(i);
        CHAINS(DECL)
        const __m512i b = _mm512_set1_epi8(3), c = _mm512_set1_epi8(-2);
        for (long it = 0; it < iters; it++) {
#define STEP(i) a##i = _mm512_dpbusd_epi32(a##i, b, c); __asm__ volatile("" : "+v"(a##i));
            CHAINS(STEP)
        }
#define SINK(i) __asm__ volatile("" :: "v"(a##i));
        CHAINS(SINK)
    }
    return (double)threads * iters * 12 * 128 / (omp_get_wtime() - t);
}
__attribute__((target("avx512f"))) double fma_flops(long iters, int threads) {
    double t = omp_get_wtime();
    #pragma omp parallel num_threads(threads)
    {
#define DECLF(i) __m512 f##i = _mm512_set1_ps(0.001f * i);
        CHAINS(DECLF)
        const __m512 b = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(1e-4f);
        for (long it = 0; it < iters; it++) {
#define STEPF(i) f##i = _mm512_fmadd_ps(f##i, b, c); __asm__ volatile("" : "+v"(f##i));
            CHAINS(STEPF)
        }
#define SINKF(i) __asm__ volatile("" :: "v"(f##i));
        CHAINS(SINKF)
    }
    return (double)threads * iters * 12 * 32 / (omp_get_wtime() - t);
}
__attribute__((target("avx512f,avx512bw,avx512bf16"))) static double dot_bf16(long iters, int threads) {
    double t = omp_get_wtime();
    #pragma omp parallel num_threads(threads)
    {
        CHAINS(DECLF)
        const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3f80), c = (__m512bh)_mm512_set1_epi16(0x3800);
        for (long it = 0; it < iters; it++) {
#define STEPB(i) f##i = _mm512_dpbf16_ps(f##i, b, c); __asm__ volatile("" : "+v"(f##i));
            CHAINS(STEPB)
        }
        CHAINS(SINKF)
    }
    return (double)threads * iters * 12 * 64 / (omp_get_wtime() - t);
}
double bf16_flops(long iters, int threads) {  /* 0 without AVX512-BF16 */
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") ? dot_bf16(iters, threads) : 0;
}
"""


def instruction_peaks(threads: int) -> tuple[float, float, float] | None:
    """(INT8 OP/s, fp32 FLOP/s, bf16 FLOP/s) at the issue rate of vpdpbusd /
    vfmadd / vdpbf16ps (0 without AVX512-BF16) on `threads` threads (best of
    3), or None without gcc or AVX-512 VNNI."""
    import ctypes
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        src, lib = f"{d}/peak.c", f"{d}/peak.so"
        with open(src, "w") as f:
            f.write(PEAK_PROBE)
        try:
            subprocess.run(["gcc", "-O2", "-fopenmp", "-shared", "-fPIC", src, "-o", lib], check=True,
                           capture_output=True)
            probe = ctypes.CDLL(lib)
        except (OSError, subprocess.CalledProcessError):
            return None
        if not (torch.backends.cpu.get_cpu_capability().startswith("AVX512")):
            return None
        fns = (probe.vnni_ops, probe.fma_flops, probe.bf16_flops)
        for fn in fns:
            fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_long, ctypes.c_int]
        return tuple(max(fn(20_000_000, threads) for _ in range(3)) for fn in fns)


def machine_limits() -> tuple[float, float, float, float]:
    """(read B/s, INT8 OP/s, fp32 FLOP/s, bf16 FLOP/s), timed as the kernels
    are (fastest call)."""
    bw = read_bandwidth(512)
    a, b = (torch.randint(-127, 128, s, dtype=torch.int8) for s in ((2048, 4096), (4096, 4096)))
    int8 = 2 * 2048 * 4096 * 4096 / fastest_call(lambda: torch._int_mm(a, b), 4)
    x, y = torch.randn(2048, 2048), torch.randn(2048, 2048)
    xb, yb = x.bfloat16(), y.bfloat16()
    return (bw, int8, 2 * 2048**3 / fastest_call(lambda: x @ y, 4),
            2 * 2048**3 / fastest_call(lambda: xb @ yb, 4))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=60)
    args = ap.parse_args()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    bw, int8_torch, fp32_torch, bf16_torch = machine_limits()
    probe = instruction_peaks(torch.get_num_threads())
    # a fraction of peak is against the higher of what torch reaches and the
    # instructions' issue rate: either is a rate this machine does reach
    torch_rates = (int8_torch, fp32_torch, bf16_torch)
    int8_peak, fp32_peak, bf16_peak = (tuple(max(a, b) for a, b in zip(torch_rates, probe)) if probe
                                       else torch_rates)
    peaks = {"int8": int8_peak, "fp32": fp32_peak, "bf16": bf16_peak}
    print(f"# Kernel roofline on this CPU ({platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads)\n")
    print(f"Measured limits: read bandwidth {bw / 1e9:.1f} GB/s (torch.sum, 512 MB); INT8 "
          f"{int8_torch / 1e12:.2f} TOPS (torch._int_mm 2048x4096x4096); fp32 {fp32_torch / 1e9:.0f} GFLOP/s "
          f"(torch.mm 2048^3); bf16 {bf16_torch / 1e9:.0f} GFLOP/s (torch's bf16 mm 2048^3).")
    if probe:
        print(f"Issue rate of the inner-loop instructions (12 independent chains per thread): vpdpbusd "
              f"{probe[0] / 1e12:.2f} TOPS, vfmadd {probe[1] / 1e9:.0f} GFLOP/s, vdpbf16ps "
              f"{probe[2] / 1e9:.0f} GFLOP/s (0: no AVX512-BF16).")
    print(f"Fractions of peak below are against INT8 {int8_peak / 1e12:.2f} TOPS, fp32 "
          f"{fp32_peak / 1e9:.0f} GFLOP/s and bf16 {bf16_peak / 1e9:.0f} GFLOP/s, the higher of the two.\n")
    print("| kernel | rows | us / call | bytes moved | GB/s | of bandwidth | GOP/s | of peak (kind) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for m in (1, 32):
        rows += list(w4a8_rows(m, g)) + list(lm_head_rows(m, g)) + list(attention_rows(m, 1024))
        rows += list(elementwise_rows(m)) + list(bf16_rows(m, g))
    rows += list(bf16_rows(1024, g))  # a bf16 prompt's linears
    rows += list(w4a8_rows(1024, g)) + list(elementwise_rows(1024))  # a W4A8KV4 prompt's
    for name, m, fn, nbytes, ops, kind in rows:
        t = fastest_call(fn, args.repeats)
        print(f"| {name} | {m} | {t * 1e6:.1f} | {nbytes / 2**20:.2f} MiB | {nbytes / t / 1e9:.1f} | "
              f"{nbytes / t / bw:.0%} | {ops / t / 1e9:.0f} | {ops / t / peaks[kind]:.0%} ({kind}) |", flush=True)


if __name__ == "__main__":
    main()
