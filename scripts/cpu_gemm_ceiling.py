#!/usr/bin/env python
"""How much faster can W4A8 make a decode step on this CPU? The GEMMs alone.

Times, for the embedded model's decode shapes (30 layers of qkv / o / gate_up /
down, plus the lm_head), one step's worth of:
  bf16   F.linear in bf16 (the BF16 engine's GEMMs)
  int8   torch._int_mm, INT8 x INT8 -> INT32 (the W4A8 engine's GEMM, nothing else)
  3pass  our earlier CPU W4A8 linear: C quantization, torch._int_mm, C epilogue
  fused  our CPU W4A8 linear now: the same three steps in one C call, VNNI GEMM
and prints bf16 / int8 and bf16 / fused per batch size. Every other part of a
step (attention, norms, sampling, Python) is left out, i.e. counted as free:
the ratios printed are an upper bound on what W4A8 can gain over BF16 here.

    python scripts/cpu_gemm_ceiling.py > docs/benchmarks/gemm_ceiling_cpu.txt
"""
import platform

import torch
import torch.nn.functional as F

from qoqserve.bench.timing import best_of_rounds
from qoqserve.kernels.cpu import w4a8_ops
from qoqserve.layers.quantization.int8_gemm import PackedInt8Gemm, fused_int8_available, int8_linear
from qoqserve.model_loader import load_model_source

REPEATS = 30


def timed(fn) -> float:
    return best_of_rounds(fn, REPEATS, warmup=3)


def main():
    arch = load_model_source(None).arch
    h, d = arch.hidden_size, arch.head_dim
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * d
    shapes = {"qkv_proj": (h, qkv), "o_proj": (arch.num_heads * d, h),
              "gate_up_proj": (h, 2 * arch.intermediate_size), "down_proj": (arch.intermediate_size, h)}
    native = w4a8_ops.load() is not None
    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, C ops: {native}, fused VNNI kernel: {fused_int8_available()}")
    print(f"# per decode step: {arch.num_layers} layers x {list(shapes)} + lm_head {h}x{arch.vocab_size}")
    print("# times in ms per step (best of 3 rounds); lm_head stays bf16 in both engines")
    print(f"{'batch':>5} {'bf16':>8} {'int8 mm':>8} {'3pass':>8} {'fused':>8} {'lm_head':>8} "
          f"{'bf16/int8':>10} {'bf16/fused':>10}")
    torch.manual_seed(0)
    for m in (1, 8, 32, 64):
        t_bf16 = t_int8 = t_3pass = t_fused = 0.0
        for k, n in shapes.values():
            xb = torch.randn(m, k, dtype=torch.bfloat16)
            wb = torch.randn(n, k, dtype=torch.bfloat16)
            xi = torch.randint(-127, 128, (max(m, 17), k), dtype=torch.int8)  # _int_mm wants M > 16
            wi = torch.randint(-127, 128, (n, k), dtype=torch.int8)
            wt = wi.t()
            s1 = torch.rand(n, dtype=torch.float16) + 0.5
            t_bf16 += timed(lambda: F.linear(xb, wb)) * arch.num_layers
            t_int8 += timed(lambda: torch._int_mm(xi, wt)) * arch.num_layers
            t_3pass += timed(lambda: int8_linear(xb, wi, s1, None, None, native)) * arch.num_layers
            fused = PackedInt8Gemm(wi, s1, None, None)
            t_fused += timed(lambda: fused(xb)) * arch.num_layers
        xb = torch.randn(m, h, dtype=torch.bfloat16)
        wl = torch.randn(arch.vocab_size, h, dtype=torch.bfloat16)
        lm = timed(lambda: F.linear(xb, wl))
        bf16, i8, p3, fu = t_bf16 + lm, t_int8 + lm, t_3pass + lm, t_fused + lm
        print(f"{m:>5} {1e3 * bf16:>8.2f} {1e3 * i8:>8.2f} {1e3 * p3:>8.2f} {1e3 * fu:>8.2f} "
              f"{1e3 * lm:>8.2f} {bf16 / i8:>10.2f} {bf16 / fu:>10.2f}")


if __name__ == "__main__":
    main()
