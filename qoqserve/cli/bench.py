"""`qoqserve bench ...`: the benchmark subcommands (offline, decode, structured, kernels,
throughput, memory, plot; the load generator `serve`: bench_serve.py)."""
from __future__ import annotations

import json
import platform

import torch

from qoqserve.cli.bench_serve import register_serve
from qoqserve.cli.engine_args import add_engine_args, engine_config


def register(sub) -> None:
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
    dec.add_argument("--enforce-eager", action="store_true", help="no captured decode steps (op by op)")
    dec.add_argument("--temperature", type=float, default=0.0, help="every request's (default 0: greedy)")
    dec.add_argument("--top-p", type=float, default=1.0)
    dec.add_argument("--json-out", default=None)
    dec.set_defaults(func=run_decode_cmd)

    st = bsub.add_parser("structured", help="decode tok/s with 0/50/100%% of the batch constrained "
                                            "to a JSON schema")
    st.add_argument("--precision", default="w4a8kv4")
    st.add_argument("--batch-size", type=int, default=32)
    st.add_argument("--fractions", nargs="+", type=float, default=[0.0, 0.5, 1.0],
                    help="constrained shares of the batch; the first is the baseline")
    st.add_argument("--input-len", type=int, default=128)
    st.add_argument("--output-len", type=int, default=64)
    st.add_argument("--rounds", type=int, default=3)
    st.add_argument("--kv-budget-gb", type=float, default=0.25)
    st.add_argument("--json-out", default=None)
    st.set_defaults(func=run_structured_cmd)

    ker = bsub.add_parser("kernels", help="GPU kernels: W4A8 GEMM vs cuBLAS INT8 vs FP16, "
                                          "KV4 decode attention vs FP16")
    ker.add_argument("--device", default="cuda")
    ker.add_argument("--tiny", action="store_true",
                     help="tiny shapes: a smoke test of the code paths (CPU: TRITON_INTERPRET=1)")
    ker.add_argument("--only", choices=["gemm", "attention"], default=None)
    ker.add_argument("--out-dir", default=None,
                     help="append each row, as measured, to OUT_DIR/kernels_gpu.jsonl and .md")
    ker.set_defaults(func=run_kernels_cmd)

    thr = bsub.add_parser("throughput", help="QServe protocol: max batch in a memory budget, "
                                             "output tok/s per precision")
    thr.add_argument("--model", default=None,
                     help="model path, synthetic:llama-3-8b etc., or default: the embedded model")
    thr.add_argument("--precisions", nargs="+", default=["bf16", "w8a8", "w4a8kv8", "w4a8kv4"])
    thr.add_argument("--input-len", type=int, default=1024)
    thr.add_argument("--output-len", type=int, default=512)
    thr.add_argument("--device", default="cpu")
    thr.add_argument("--memory-gb", type=float, default=None,
                     help="budget for weights + KV (default on CUDA: 90%% of the device)")
    thr.add_argument("--reserve-gb", type=float, default=0.0, help="kept for activations")
    thr.add_argument("--max-batch", type=int, default=256)
    thr.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, dest="tp",
                     help="ranks the model is split over (budget and sizes per rank)")
    thr.add_argument("--json-out", default=None)
    thr.set_defaults(func=run_throughput_cmd)

    mem = bsub.add_parser("memory", help="weights, KV bytes/token, pages and max sequences per precision")
    mem.add_argument("--model", default=None)
    mem.add_argument("--precisions", nargs="+", default=["fp16", "bf16", "w8a8", "w4a8kv8", "w4a8kv4"])
    mem.add_argument("--device", default="cuda", help="cuda: packed W4 weights; cpu: INT8 expansion")
    mem.add_argument("--memory-gb", type=float, default=None, help="total budget for weights + KV")
    mem.add_argument("--kv-budget-gb", type=float, default=None, help="or a fixed KV budget")
    mem.add_argument("--reserve-gb", type=float, default=0.0)
    mem.add_argument("--seq-len", type=int, default=1536, help="tokens per sequence (input + output)")
    mem.add_argument("--group-size", type=int, default=128)
    mem.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, dest="tp",
                     help="ranks the model is split over: weights, KV and budget per rank")
    mem.add_argument("--max-num-seqs", type=int, default=None,
                     help="the engine's (default: its default): it sizes the sliding-window layers' own "
                          "pool where only some layers slide")
    mem.add_argument("--max-model-len", type=int, default=None, help="the engine's (default: the model's)")
    mem.add_argument("--json-out", default=None)
    mem.set_defaults(func=run_memory_cmd)

    register_serve(bsub)

    plot = bsub.add_parser("plot", help="PNG plots of benchmark JSON")
    plot.add_argument("kind", choices=["throughput", "latency"])
    plot.add_argument("inputs", nargs="+",
                      help="throughput: a `bench decode`/`bench throughput` JSON; latency: "
                           "LABEL=FILE for each `bench serve` sweep JSON")
    plot.add_argument("-o", "--out", required=True)
    plot.add_argument("--title", default="")
    plot.set_defaults(func=run_plot_cmd)


def run_plot_cmd(args) -> int:
    # lazy: CLI start-up (load what a subcommand needs when it runs)
    from qoqserve.bench.plots import (
        load_json,
        plot_latency_vs_load,
        plot_throughput_vs_batch,
    )

    if args.kind == "throughput":
        rows = []
        for path in args.inputs:
            data = load_json(path)
            rows += data["results"] if isinstance(data, dict) else data
        plot_throughput_vs_batch(rows, args.out, args.title)
    else:
        sweeps = {}
        for item in args.inputs:
            label, _, path = item.rpartition("=")
            data = load_json(path)
            sweeps[label or path] = data if isinstance(data, list) else [data]
        plot_latency_vs_load(sweeps, args.out, args.title)
    print(f"wrote {args.out}")
    return 0


def run_throughput_cmd(args) -> int:
    # lazy: CLI start-up (load what a subcommand needs when it runs)
    from qoqserve.bench.throughput import as_dicts, bench_throughput

    print(f"# {args.device}, torch {torch.__version__}; input {args.input_len}, output "
          f"{args.output_len}, memory {args.memory_gb} GiB, EOS ignored")
    results = bench_throughput(args.model, args.precisions, args.input_len, args.output_len,
                               args.device, args.memory_gb, args.reserve_gb, args.max_batch, tp=args.tp)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"device": args.device, "torch": torch.__version__, "results": as_dicts(results)},
                      f, indent=2)
    return 0


def run_memory_cmd(args) -> int:
    # lazy: CLI start-up (load what a subcommand needs when it runs)
    from qoqserve.bench.memory import as_dicts, format_plans, plan_memory
    from qoqserve.bench.precisions import get_precision, model_for
    from qoqserve.model_loader import load_model_source

    if (args.memory_gb is None) == (args.kv_budget_gb is None):
        raise ValueError("give exactly one of --memory-gb and --kv-budget-gb")
    def gb(v):
        return None if v is None else int(v * 2**30)

    plans = []
    for name in args.precisions:
        p = get_precision(name)
        # only the architecture is read: QoQ precisions need no checkpoint here
        arch = load_model_source(model_for(get_precision("fp16"), args.model)).arch
        plans.append(plan_memory(arch, p, args.device, args.seq_len, budget_bytes=gb(args.kv_budget_gb),
                                 memory_bytes=gb(args.memory_gb), reserve_bytes=gb(args.reserve_gb),
                                 group_size=args.group_size, tp=args.tp, max_num_seqs=args.max_num_seqs,
                                 max_positions=args.max_model_len))
    print(format_plans(plans))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(as_dicts(plans), f, indent=2)
    return 0


def run_kernels_cmd(args) -> int:
    # lazy: CLI start-up (load what a subcommand needs when it runs)
    from qoqserve.bench.kernels import check_device, run
    from qoqserve.bench.rows import RowWriter

    check_device(args.device, args.tiny)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.machine()
    print(f"# {name}, torch {torch.__version__}, do_bench median, L2 flushed"
          + (" (tiny shapes: smoke test, timings meaningless)" if args.tiny else ""), flush=True)
    rows = run(args.device, args.tiny, args.only, RowWriter(args.out_dir))
    failed = [r for r in rows if r.error]
    print(f"# {len(rows)} rows, {len(failed)} failed", flush=True)
    return 1 if failed else 0


def run_decode_cmd(args) -> int:
    # lazy: CLI start-up (load what a subcommand needs when it runs)
    from qoqserve.bench.decode import as_dicts, bench_decode

    sampling = {"temperature": args.temperature, "top_p": args.top_p} if args.temperature else None
    print(f"# {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"input {args.input_len}, output {args.output_len}, compile={args.compile}, "
          f"enforce_eager={args.enforce_eager}, sampling={sampling or 'greedy'}")
    results = bench_decode(args.precisions, args.batch_sizes, args.input_len, args.output_len,
                           args.kv_budget_gb, args.compile, enforce_eager=args.enforce_eager, sampling=sampling)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "torch": torch.__version__,
                       "input_len": args.input_len, "output_len": args.output_len,
                       "compile": args.compile, "enforce_eager": args.enforce_eager, "sampling": sampling,
                       "results": as_dicts(results)}, f, indent=2)
    return 0


def run_structured_cmd(args) -> int:
    # lazy: CLI start-up (load what a subcommand needs when it runs)
    from qoqserve.bench.structured import as_dicts, bench_structured

    print(f"# {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"{args.precision}, batch {args.batch_size}, input {args.input_len}, output {args.output_len}, "
          f"greedy, EOS ignored, {args.rounds} rounds")
    results = bench_structured(args.precision, args.batch_size, args.fractions, args.input_len,
                               args.output_len, args.rounds, args.kv_budget_gb)
    for r in results:
        print(f"{100 * r.constrained_fraction:3.0f}% constrained: best {r.best_tok_per_s:7.1f} tok/s "
              f"(rounds {', '.join(f'{s:.1f}' for s in r.decode_tok_per_s)}); "
              f"{100 * r.slowdown_vs_free:+.1f}% slower than {100 * results[0].constrained_fraction:.0f}%; "
              f"masks {r.mask_ms_per_step:.2f} ms per {r.step_ms:.1f} ms step")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "torch": torch.__version__,
                       "precision": args.precision, "results": as_dicts(results)}, f, indent=2)
    return 0


def run_offline_cmd(args) -> int:
    # lazy: CLI start-up (load what a subcommand needs when it runs)
    from qoqserve.bench.offline import as_dicts, run_offline
    from qoqserve.quant.default_checkpoint import resolve_model

    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    results = run_offline(engine_config(args, resolve_model(args.model)), args.dtypes,
                          args.batch_sizes, args.input_len, args.output_len, not args.no_transformers)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "torch": torch.__version__,
                       "results": as_dicts(results)}, f, indent=2)
    return 0
