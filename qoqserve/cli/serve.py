"""`qoqserve serve [MODEL]`: the OpenAI-compatible HTTP server."""
from __future__ import annotations

import os
import sys

from qoqserve.cli.engine_args import add_engine_args, make_engine


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="HF dir, .gguf file or a qoq alias: qoq, qoq-tuned, qoq-chn (default: qoq, the "
                        "embedded model in QoQ g64, quantized on first use and cached)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("QOQSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $QOQSERVE_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: its name)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 2**20,
                   help="larger request bodies get a 413 before they are read (default 4 MiB)")
    p.add_argument("--graceful-shutdown-s", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight requests may take to finish before abort")
    p.add_argument("--max-waiting-queue-length", type=int, default=1024,
                   help="requests waiting for their first token beyond which new ones get a 429 with "
                        "Retry-After (0: unbounded; default 1024)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat_template (otherwise a 400)")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    # lazy: CLI start-up
    from qoqserve.server.config import ServerConfig
    from qoqserve.server.launch import serve

    if args.model_path and args.model:
        raise ValueError("give the model either as MODEL or as --model, not both")
    model = args.model_path or args.model or "qoq"
    config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                          served_model_name=args.served_model_name, max_body_bytes=args.max_body_bytes,
                          graceful_shutdown_s=args.graceful_shutdown_s,
                          max_waiting_queue_length=args.max_waiting_queue_length,
                          trust_request_chat_template=args.trust_request_chat_template)
    engine = make_engine(args, model)
    s = engine.stats()
    print(f"qoqserve: serving {config.served_model_name or engine.model_name} on "
          f"http://{config.host}:{config.port}/v1 ({s['dtype']}, KV {s['kv_layout']}, "
          f"{s['num_kv_blocks']} pages x {s['block_size']}, context {engine.max_model_len})",
          file=sys.stderr, flush=True)
    serve(engine, config, log_level="info" if args.verbose else "warning")
    print("qoqserve: stopped", file=sys.stderr, flush=True)
    return 0
