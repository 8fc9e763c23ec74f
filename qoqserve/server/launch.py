"""Start the server: engine thread, app, uvicorn, and SIGTERM handling."""
from __future__ import annotations

import signal

import uvicorn
from fastapi import FastAPI

from qoqserve.server.app import build_app
from qoqserve.server.async_engine import AsyncEngine
from qoqserve.server.config import ServerConfig
from qoqserve.server.metrics import ServerMetrics


def build_server(llm_engine, config: ServerConfig) -> tuple[FastAPI, AsyncEngine]:
    """The app and its engine thread, wired to one metrics registry."""
    name = config.served_model_name or llm_engine.model_name
    metrics = ServerMetrics(name, lambda: engine.stats)  # engine is bound just below
    engine = AsyncEngine(llm_engine, on_step=metrics.on_step)
    return build_app(engine, config, name, metrics), engine


class _DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT uvicorn stops accepting and waits for open responses; we
    also tell the engine to end what is still running when the grace period is
    over, so every stream closes with a final chunk and [DONE] instead of being
    cut by uvicorn's own timeout (kept as a backstop)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace_s: float):
        super().__init__(config)
        self.engine = engine
        self.grace_s = grace_s

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self.engine.drain(self.grace_s)
        super().handle_exit(sig, frame)


def serve(llm_engine, config: ServerConfig, log_level: str = "warning") -> None:
    app, engine = build_server(llm_engine, config)
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level,
                        timeout_graceful_shutdown=config.graceful_shutdown_s + 5.0)
    # uvicorn re-raises the signal it caught once it has shut down; with these
    # handlers in place that ends run() normally, so a clean stop exits 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    _DrainingServer(uv, engine, config.graceful_shutdown_s).run()
