import os, sys, time, torch
sys.path.insert(0, "tests")
from test_paged_prefill import _case, _queries
for L, B in [(64, 64), (128, 32), (256, 16), (512, 8)]:
    layout, attn, cache, tables = _case("int4", 9, 3, 64, 16, [L] * B)
    q = _queries(L * B, 9, 64, seed=1)
    starts = [i * L for i in range(B + 1)]
    def run():
        best = 1e9
        for _ in range(20):
            t = time.perf_counter(); attn.prefill(q, cache, tables, starts, [0] * B, 0.125); best = min(best, time.perf_counter() - t)
        return best
    r = []
    for rep in range(3):
        os.environ.pop("QOQSERVE_CPU_ISA", None); a = run()
        os.environ["QOQSERVE_CPU_ISA"] = "avx512-vnni"; f = run()
        r.append(f"{a*1e3:.2f}/{f*1e3:.2f}")
    print(f"{B}x{L} amx/fp32 ms:", " ".join(r))
