"""HTTP server settings (the engine's are in qoqserve.config)."""
from __future__ import annotations

from dataclasses import dataclass, field


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
    # CORS, vLLM's flags and defaults (llama.cpp's server allows every origin too):
    # browser clients may call the API; the API key still guards /v1
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    ssl_keyfile: str | None = None   # with ssl_certfile: HTTPS
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    root_path: str = ""              # behind a proxy that serves the API under a path prefix
    responses_store_size: int = 256  # stored /v1/responses kept in memory, newest first

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"
