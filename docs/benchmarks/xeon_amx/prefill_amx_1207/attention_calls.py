"""One layer's prefill attention call over KV4 pages (by default 9 query heads,
3 KV heads, head_dim 64 as the embedded model; block 16), the AMX tiles (default) against
QOQSERVE_CPU_ISA=avx512-vnni (the fp32 AVX-512 path for every query), three
rounds taking turns. Run from the repository root:

    python docs/benchmarks/xeon_amx/prefill_amx_1207/attention_calls.py 64x64 32x128 16x256 8x512 --calls 20
    python docs/benchmarks/xeon_amx/prefill_amx_1207/attention_calls.py 1x512 1x768 1x1024 4x1024 1x2048 --calls 10
    python docs/benchmarks/xeon_amx/prefill_amx_1207/attention_calls.py 1x1024 1x2048 --calls 5 --heads 32 8 128
"""
import argparse
import os
import sys
import time

sys.path.insert(0, "tests")
from test_paged_prefill import _case, _queries  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("shapes", nargs="+", help="BxL: B prompts of L tokens from position 0")
ap.add_argument("--calls", type=int, default=10)
ap.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("H", "HKV", "D"))
args = ap.parse_args()
for shape in args.shapes:
    B, L = map(int, shape.split("x"))
    H, HKV, D = args.heads
    layout, attn, cache, tables = _case("int4", H, HKV, D, 16, [L] * B)
    q = _queries(L * B, H, D, seed=1)
    starts = [i * L for i in range(B + 1)]

    def fastest():
        best = 1e9
        for _ in range(args.calls):
            t = time.perf_counter()
            attn.prefill(q, cache, tables, starts, [0] * B, D ** -0.5)
            best = min(best, time.perf_counter() - t)
        return best

    r = []
    for _ in range(3):
        os.environ.pop("QOQSERVE_CPU_ISA", None)
        a = fastest()
        os.environ["QOQSERVE_CPU_ISA"] = "avx512-vnni"
        f = fastest()
        r.append(f"{a * 1e3:.2f}/{f * 1e3:.2f}")
    print(f"{B}x{L}" + ("" if args.heads == [9, 3, 64] else f" H{H} HKV{HKV} D{D}"), "amx/fp32 ms:", " ".join(r),
          flush=True)
