"""The GPU kernel benchmark's code paths, smoke-tested on tiny shapes in the
Triton interpreter, so a lent GPU's few minutes are not lost to a typo."""
from qoqserve.bench.kernels import format_rows, run


def test_kernel_benchmark_runs_every_implementation_on_tiny_shapes():
    rows = run("cpu", tiny=True)
    impls = {r.impl for r in rows}
    assert {"cuBLAS INT8 (torch._int_mm)", "FP16 torch.matmul", "W4A8 g64 (ours)", "W4A8 g128 (ours)",
            "W4A8 per-channel (ours)", "KV4 paged decode (ours, Triton)",
            "FP16 SDPA, contiguous cache"} <= impls
    assert all(r.ms > 0 and r.ratio > 0 for r in rows)
    assert format_rows(rows).count("\n") == len(rows) + 1
