"""`qoqserve bench offline`: engine throughput vs transformers, side by side."""
from __future__ import annotations

import json
import platform

import torch


def register(sub, add_engine_args) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench_command", required=True)
    off = bsub.add_parser("offline", help="offline generation throughput vs transformers")
    off.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    off.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32])
    off.add_argument("--input-len", type=int, default=128)
    off.add_argument("--output-len", type=int, default=128)
    off.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    off.add_argument("--json-out", default=None, help="write results as JSON to this file")
    add_engine_args(off)
    off.set_defaults(func=run_offline_cmd)

    dec = bsub.add_parser("decode", help="decode throughput per precision (fp32/bf16/w8a8/w4a8kv4)")
    dec.add_argument("--precisions", nargs="+",
                     default=["fp32", "bf16", "w8a8", "w4a8kv4", "w4a8kv4-bf16"])
    dec.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32, 64])
    dec.add_argument("--input-len", type=int, default=128)
    dec.add_argument("--output-len", type=int, default=64)
    dec.add_argument("--kv-budget-gb", type=float, default=0.25,
                     help="KV page pool per engine; also the budget of the max-batch column")
    dec.add_argument("--compile", action="store_true", help="torch.compile the decode attention")
    dec.add_argument("--json-out", default=None)
    dec.set_defaults(func=run_decode_cmd)

    ker = bsub.add_parser("kernels", help="GPU kernels: W4A8 GEMM vs cuBLAS INT8 vs FP16, "
                                          "KV4 decode attention vs FP16")
    ker.add_argument("--device", default="cuda")
    ker.add_argument("--iters", type=int, default=20)
    ker.add_argument("--tiny", action="store_true",
                     help="tiny shapes: a smoke test of the code paths (CPU: TRITON_INTERPRET=1)")
    ker.add_argument("--json-out", default=None)
    ker.set_defaults(func=run_kernels_cmd)


def run_kernels_cmd(args) -> int:
    from qoqserve.bench.kernels import as_dicts, format_rows, run

    rows = run(args.device, args.tiny, args.iters)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.machine()
    print(f"# {name}, torch {torch.__version__}, median of {args.iters} runs"
          + (" (tiny shapes: smoke test, timings meaningless)" if args.tiny else ""))
    print(format_rows(rows))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "tiny": args.tiny,
                       "rows": as_dicts(rows)}, f, indent=2)
    return 0


def run_decode_cmd(args) -> int:
    from qoqserve.bench.decode import as_dicts, bench_decode

    print(f"# {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"input {args.input_len}, output {args.output_len}, compile={args.compile}")
    results = bench_decode(args.precisions, args.batch_sizes, args.input_len, args.output_len,
                           args.kv_budget_gb, args.compile)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "torch": torch.__version__,
                       "input_len": args.input_len, "output_len": args.output_len,
                       "compile": args.compile, "results": as_dicts(results)}, f, indent=2)
    return 0


def run_offline_cmd(args) -> int:
    from qoqserve.bench.offline import as_dicts, run_offline
    from qoqserve.cli.main import engine_kwargs

    kwargs = engine_kwargs(args)
    kwargs.pop("dtype")
    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    results = run_offline(args.model, args.dtypes, args.batch_sizes, args.input_len,
                          args.output_len, not args.no_transformers, kwargs)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "torch": torch.__version__,
                       "results": as_dicts(results)}, f, indent=2)
    return 0
