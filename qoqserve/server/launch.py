"""Start the server: the engine loop on the main thread, uvicorn on another,
and SIGTERM handling."""
from __future__ import annotations

import gc
import logging
import signal
import threading

import uvicorn
from fastapi import FastAPI

from qoqserve.server.app import build_app
from qoqserve.server.async_engine import AsyncEngine
from qoqserve.server.config import ServerConfig
from qoqserve.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


def build_server(llm_engine, config: ServerConfig, own_thread: bool = True) -> tuple[FastAPI, AsyncEngine]:
    """The app and its engine (on a thread of its own unless own_thread is
    False), wired to one metrics registry."""
    names = config.served_model_name or [llm_engine.model_name]
    metrics = ServerMetrics(names[0], lambda: engine.stats)  # engine is bound just below
    engine = AsyncEngine(llm_engine, on_step=metrics.on_step, own_thread=own_thread,
                         max_waiting=config.max_waiting_queue_length, retry_after_s=config.retry_after_s)
    return build_app(engine, config, names, metrics), engine


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
    # The engine loop runs on the main thread: the CPU kernels' OpenMP teams
    # start fast only there (from another thread each parallel region cost
    # ~60 us more, doubling a batch-1 step). uvicorn runs on a second thread,
    # where it installs no signal handlers, so the main thread forwards them.
    app, engine = build_server(llm_engine, config, own_thread=False)
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level,
                        timeout_graceful_shutdown=config.graceful_shutdown_s + 5.0, root_path=config.root_path,
                        ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile,
                        ssl_ca_certs=config.ssl_ca_certs)
    server = _DrainingServer(uv, engine, config.graceful_shutdown_s)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.handle_exit)

    def run_http():
        try:
            server.run()
        finally:  # however uvicorn ends (a port in use included), the engine loop ends too
            engine.shutdown(timeout=0)

    # The heap made at start-up (model, tokenizer, libraries) lives as long as
    # the process, yet every full collection would walk all of it while the
    # engine loop waits for the GIL: the stall lands in the streams' token
    # intervals. Frozen, collections only walk what serving allocates (vLLM
    # does the same after its engine starts).
    gc.collect()
    gc.freeze()
    http = threading.Thread(target=run_http, name="qoqserve-http", daemon=True)
    http.start()
    try:
        engine.run_loop()  # until the app's shutdown stops the engine
    except Exception:
        # a dead engine must not take the HTTP side with it: /health and every
        # request answer 503 until the server is stopped
        log.exception("the engine loop died; serving 503s until stopped")
        while http.is_alive():
            http.join(0.5)
    http.join(config.graceful_shutdown_s + 10.0)
    if not server.started:
        raise RuntimeError(f"the HTTP server did not start on {config.host}:{config.port} "
                           "(port in use? see the log above)")
