"""HTTP server settings (the engine's are in qoqserve.config); `qoqserve
serve`'s flags are generated from these fields (cli/config_args.py)."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

from qoqserve.config import opt
from qoqserve.server.reasoning import PARSERS


def _every() -> list[str]:
    return ["*"]


def json_list(text: str) -> list[str]:
    """A flag's JSON list of strings, e.g. '["*"]'."""
    try:
        v = json.loads(text)
    except ValueError:
        v = None
    if not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
        raise argparse.ArgumentTypeError(f'expected a JSON list of strings such as ["*"], got {text!r}')
    return v


def _cors(what: str):
    return field(default_factory=_every, metadata={"help": f"CORS: {what}, a JSON list", "type": json_list})


@dataclass
class ServerConfig:
    host: str = opt("127.0.0.1", "address to listen on (loopback unless the operator opens it up)")
    port: int = opt(8000, "port to listen on")
    api_key: str | None = opt(None, "require 'Authorization: Bearer KEY' on /v1/* (default: $QOQSERVE_API_KEY)",
                              env="QOQSERVE_API_KEY")
    served_model_name: list[str] | str | None = opt(
        None, "model id clients send (default: its name); several: every one is taken, the first "
              "answers (vLLM's: e.g. an alias an app has written in)", nargs="+")
    max_body_bytes: int = opt(4 * 2**20, "larger request bodies get a 413 before they are read (default 4 MiB)")
    graceful_shutdown_s: float = opt(30.0, "on SIGTERM, how long in-flight requests may take to finish before abort")
    # generous, so normal use never meets it: it is there to stop a flood, not to shape load
    max_waiting_queue_length: int | None = opt(
        1024, "requests waiting for their first token beyond which new ones get a 429 with Retry-After "
              "(0: unbounded)")
    retry_after_s: int = opt(1, "the 429's Retry-After", cli=False)
    # a request's own chat_template runs in Jinja's sandbox, yet it is code the
    # operator did not choose: off unless asked for (vLLM's flag, vLLM's default)
    trust_request_chat_template: bool = opt(False, "let requests bring their own chat_template (else a 400)")
    # CORS, vLLM's flags and defaults (llama.cpp's server allows every origin too):
    # browser clients may call the API; the API key still guards /v1
    allowed_origins: list[str] = _cors("the origins browsers may call from")
    allowed_methods: list[str] = _cors("the methods allowed")
    allowed_headers: list[str] = _cors("the request headers allowed")
    allow_credentials: bool = opt(False, "CORS: allow credentials")
    ssl_keyfile: str | None = opt(None, "with --ssl-certfile: serve HTTPS")
    ssl_certfile: str | None = opt(None, "the certificate for HTTPS")
    ssl_ca_certs: str | None = opt(None, "CA certificates file")
    root_path: str = opt("", "the path prefix under which a proxy serves the API (and strips)")
    # vLLM's tool-call flags, taken so that its command lines run unchanged: here a
    # request with tools is always constrained to, and parsed for, Hermes calls
    enable_auto_tool_choice: bool = opt(False, "accepted (vLLM's): tool_choice auto is always on for "
                                               "requests with tools")
    tool_call_parser: str | None = opt(None, "accepted (vLLM's): calls are read in the Hermes format "
                                             "(<tool_call> JSON </tool_call>: Qwen2.5/Qwen3, Hermes)",
                                       choices=("hermes",))
    reasoning_parser: str | None = opt(None, "split a thinking model's <think> ... </think> from its answer "
                                             "into the chat message's `reasoning` (vLLM's names)",
                                       choices=PARSERS)
    responses_store_size: int = opt(256, "stored /v1/responses (store: true) kept in memory for "
                                         "previous_response_id and GET")

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]
        if self.served_model_name is not None and not self.served_model_name:
            raise ValueError("served_model_name: give at least one name")
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"
