"""`qoqserve serve [MODEL]`: the OpenAI-compatible HTTP server."""
from __future__ import annotations

import sys

from qoqserve.cli.config_args import add_config_args, picked
from qoqserve.cli.engine_args import add_engine_args, make_engine
from qoqserve.server.config import ServerConfig


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="HF dir, .gguf file, a cached Hugging Face id or a qoq alias: qoq, qoq-tuned, qoq-chn "
                        "(default: qoq, the "
                        "embedded model in QoQ g64, quantized on first use and cached)")
    add_config_args(p.add_argument_group("server"), ServerConfig)
    add_engine_args(p)
    _add_vllm_no_ops(p.add_argument_group("vLLM flags taken so its command lines run; each is what qoqserve "
                                          "always does"))
    p.set_defaults(func=run)


# vLLM flags whose behaviour is this server's only one: taken, changing nothing
_VLLM_NO_OPS = {
    "--trust-remote-code": "no model's own code is ever run here",
    "--enable-chunked-prefill": "prompts are always prefilled in chunks (--max-num-batched-tokens)",
    "--disable-log-requests": "requests are logged only with -v",
    "--disable-log-stats": "no periodic stats are logged (GET /metrics has them)",
}


def _add_vllm_no_ops(group) -> None:
    for flag, why in _VLLM_NO_OPS.items():
        group.add_argument(flag, action="store_true", help=why)


def run(args) -> int:
    # lazy: CLI start-up
    from qoqserve.server.launch import serve

    if args.model_path and args.model:
        raise ValueError("give the model either as MODEL or as --model, not both")
    model = args.model_path or args.model or "qoq"
    config = ServerConfig(**picked(ServerConfig, args))
    engine = make_engine(args, model)
    s = engine.stats()
    print(f"qoqserve: serving {' = '.join(config.served_model_name or [engine.model_name])} on "
          f"{config.scheme}://{config.host}:{config.port}/v1 ({s['dtype']}, KV {s['kv_layout']}, "
          f"{s['num_kv_blocks']} pages x {s['block_size']}, context {engine.max_model_len})",
          file=sys.stderr, flush=True)
    serve(engine, config, log_level="info" if args.verbose else "warning")
    print("qoqserve: stopped", file=sys.stderr, flush=True)
    return 0
