"""The GPU kernel benchmark's code paths, smoke-tested on tiny shapes in the
Triton interpreter, so a lent GPU's few minutes are not lost to a typo; and
its row writer, which must keep every row measured before a crash."""
import json

from qoqserve.bench.kernels import measure, run
from qoqserve.bench.rows import MD_HEADER, RowWriter, read_jsonl


def test_kernel_benchmark_runs_every_implementation_on_tiny_shapes(tmp_path):
    rows = run("cpu", tiny=True, writer=RowWriter(str(tmp_path), echo=False))
    assert not [r for r in rows if r.error], [r for r in rows if r.error]
    impls = {r.impl for r in rows}
    assert {"cuBLAS INT8 (torch._int_mm)", "FP16 torch.matmul", "W4A8 g64 (ours)", "W4A8 g128 (ours)",
            "W4A8 per-channel (ours)", "KV4 paged decode (ours, Triton)",
            "KV4 paged decode, no context split", "FP16 paged decode (ours, Triton, same kernel)",
            "FP16 SDPA, contiguous cache", "KV4 write (ours, Triton)"} <= impls
    assert all(r.ms > 0 and r.ratio > 0 for r in rows)
    assert all(r.backend for r in rows if r.impl.startswith("FP16 SDPA"))  # which backend ran
    saved = read_jsonl(str(tmp_path / "kernels_gpu.jsonl"))
    assert [d["impl"] for d in saved] == [r.impl for r in rows]
    md = (tmp_path / "kernels_gpu.md").read_text()
    assert md.startswith(MD_HEADER) and md.count("\n") == len(rows) + 2


def test_a_failing_case_leaves_an_error_row_and_the_rows_before_it(tmp_path):
    import torch

    w = RowWriter(str(tmp_path), echo=False)
    cpu = torch.device("cpu")
    t = measure(w, "gemm", "s", "fine", lambda: torch.ones(4).sum(), cpu)
    assert measure(w, "gemm", "s", "broken", lambda: 1 / 0, cpu, t, "fine") is None
    measure(w, "gemm", "s", "after", lambda: torch.ones(4).sum(), cpu, None, "broken-baseline")
    saved = [json.loads(x) for x in (tmp_path / "kernels_gpu.jsonl").read_text().splitlines()]
    assert [d["impl"] for d in saved] == ["fine", "broken", "after"]
    assert saved[1]["ms"] is None and "ZeroDivisionError" in saved[1]["error"]
    assert saved[2]["ratio"] is None and saved[2]["ms"] > 0   # no baseline time, no ratio
    # a second writer (the next stage of gpu_check.sh) appends, header once
    RowWriter(str(tmp_path), echo=False).add(w.rows[0])
    assert (tmp_path / "kernels_gpu.md").read_text().count("| bench |") == 1


def test_without_cuda_the_command_says_what_to_run_and_prints_no_table(monkeypatch, capsys):
    import torch

    from qoqserve.cli.main import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "kernels"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "needs a CUDA device, and this torch has none" in err and "--tiny" in err
    assert main(["bench", "kernels", "--device", "cpu"]) == 2
    assert "cpu is not one" in capsys.readouterr().err
