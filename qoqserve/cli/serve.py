"""`qoqserve serve [MODEL]`: the OpenAI-compatible HTTP server."""
from __future__ import annotations

import argparse
import json
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
    for name, what in (("origins", "origins"), ("methods", "methods"), ("headers", "request headers")):
        p.add_argument(f"--allowed-{name}", type=_json_list, default=["*"],
                       help=f'CORS: the {what} browsers may call from, a JSON list (default ["*"])')
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument("--ssl-keyfile", default=None, help="with --ssl-certfile: serve HTTPS")
    p.add_argument("--ssl-certfile", default=None)
    p.add_argument("--ssl-ca-certs", default=None, help="CA certificates file")
    p.add_argument("--root-path", default="", help="the path prefix a proxy serves the API under")
    p.add_argument("--responses-store-size", type=int, default=256,
                   help="stored /v1/responses (store: true) kept in memory for previous_response_id and GET")
    add_engine_args(p)
    p.set_defaults(func=run)


def _json_list(text: str) -> list[str]:
    try:
        v = json.loads(text)
    except ValueError:
        v = None
    if not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
        raise argparse.ArgumentTypeError(f'expected a JSON list of strings such as ["*"], got {text!r}')
    return v


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
                          trust_request_chat_template=args.trust_request_chat_template,
                          allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                          allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
                          ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                          ssl_ca_certs=args.ssl_ca_certs, root_path=args.root_path,
                          responses_store_size=args.responses_store_size)
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    engine = make_engine(args, model)
    s = engine.stats()
    print(f"qoqserve: serving {config.served_model_name or engine.model_name} on "
          f"{config.scheme}://{config.host}:{config.port}/v1 ({s['dtype']}, KV {s['kv_layout']}, "
          f"{s['num_kv_blocks']} pages x {s['block_size']}, context {engine.max_model_len})",
          file=sys.stderr, flush=True)
    serve(engine, config, log_level="info" if args.verbose else "warning")
    print("qoqserve: stopped", file=sys.stderr, flush=True)
    return 0
