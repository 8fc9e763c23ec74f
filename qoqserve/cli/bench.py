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
