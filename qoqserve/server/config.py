"""HTTP server settings (the engine's are in qoqserve.config)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"        # loopback unless the operator opens it up
    port: int = 8000
    api_key: str | None = None     # Bearer token required on /v1/* when set
    served_model_name: str | None = None  # default: the model's own name
    max_body_bytes: int = 4 * 2**20
    graceful_shutdown_s: float = 30.0     # on SIGTERM, in-flight requests get this long to finish
    log_level: str = "info"
    # waiting requests (admitted, no token yet) before new ones get a 429; generous,
    # so normal use never meets it: it is there to stop a flood, not to shape load
    max_waiting_queue_length: int | None = 1024
    retry_after_s: int = 1                # the 429's Retry-After
    # a request's own chat_template runs in Jinja's sandbox, yet it is code the
    # operator did not choose: off unless asked for (vLLM's flag, vLLM's default)
    trust_request_chat_template: bool = False
