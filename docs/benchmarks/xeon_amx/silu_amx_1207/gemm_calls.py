"""Two W4A8 GEMM shapes of the embedded model (down_proj 576x1536, gate_up
3072x576, g64) at 32 and 2,048 rows: the fastest of 30 calls, in us. Run
from the repository root with PYTHONPATH set to the tree under test, each
tree in turn (benchmarks.md, "Prefill on AMX hosts")."""

import sys

import torch

sys.path.insert(0, "tests")
import test_w4a8_packed_gemm as T  # noqa: E402

from qoqserve.bench.timing import fastest_call  # noqa: E402
from qoqserve.kernels.cpu.w4a8_gemm import PackedW4A8Gemm  # noqa: E402

out = []
for n, k in ((576, 1536), (3072, 576)):
    c = T._checkpoint(n, k, 64, seed=1)
    mod = PackedW4A8Gemm(c["qweight"], c["s1"], c["s2"], c["zeros"], None, 64)
    for m in (32, 2048):
        x = torch.randn(m, k)
        out.append(f"{n}x{k} m{m}: {fastest_call(lambda: mod(x), 30) * 1e6:.0f}us")
print(" | ".join(out))
