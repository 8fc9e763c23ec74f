"""`qoqserve` command line: generate, serve, quantize, eval, bench."""
from __future__ import annotations

import argparse
import logging
import sys

from qoqserve.cli import bench, check_kernels, convert, evaluate, generate, quantize, serve


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF checkpoint dir or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", help="auto|float32|bfloat16|float16")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "int4", "int8", "float16", "fp16", "bfloat16", "bf16", "float32"],
                   help="auto: int4 for QoQ KV4 checkpoints (int8 for KV8 ones), else the model dtype")
    g.add_argument("--w4a8-backend", default="auto",
                   choices=["auto", "torch-int8", "torch-int8-percall", "sim", "triton"],
                   help="how QoQ W4A8 linears run: INT8 weights expanded at load (1 B/weight), "
                        "expanded per call from packed codes (0.5 B/weight), the fp32 simulation, "
                        "or the Triton GEMM (CUDA; auto picks it there)")
    g.add_argument("--kernels", default="auto", choices=["auto", "torch", "cpu", "triton"],
                   help="auto: Triton kernels on CUDA (W4A8 GEMM, fused quant, KV4 attention); on "
                        "CPU the C KV4 decode kernel (built on first use) and torch; torch: torch only")
    g.add_argument("--quantization", default=None, choices=["w8a8"],
                   help="quantize a full-precision checkpoint at load (W8A8 baseline)")
    g.add_argument("--kv-cache-gb", type=float, default=None, help="KV page pool size in GiB")
    g.add_argument("--kv-cache-fraction", type=float, default=0.3,
                   help="KV pool as a fraction of free memory when --kv-cache-gb is not given "
                        "(capped at 2 GiB on CPU)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=4096)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the decode attention (faster decode; ~30 s warm-up)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, device=args.device, kv_cache_dtype=args.kv_cache_dtype,
                kv_cache_gb=args.kv_cache_gb, kv_cache_fraction=args.kv_cache_fraction,
                block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len,
                enable_prefix_caching=not args.no_prefix_caching, seed=args.seed,
                w4a8_backend=args.w4a8_backend, kernels=args.kernels,
                quantization=args.quantization,
                compile=args.compile)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qoqserve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (generate, serve, quantize, evaluate, bench, convert, check_kernels):
        module.register(sub, add_engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"qoqserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
