"""The HTTP layer: routes and error shapes over OpenAIServing.

Every error leaves as OpenAI's `{"error": {message, type, param, code}}`:
the handlers' own, FastAPI's body validation (mapped from its 422 to a 400
naming the field), unknown routes (404), wrong methods (405 with `Allow`),
the guard's 401 and 413, a full waiting queue (429 with Retry-After), and
anything unexpected (500).
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from qoqserve.errors import InvalidRequestError, QueueFullError
from qoqserve.server import tokenization
from qoqserve.server.async_engine import AsyncEngine, EngineDeadError
from qoqserve.server.config import ServerConfig
from qoqserve.server.guard import GuardMiddleware
from qoqserve.server.metrics import ServerMetrics
from qoqserve.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_response,
    from_validation_errors,
)
from qoqserve.server.responses import (
    ERRORS,
    STREAM,
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ErrorResponse,
    Health,
    ModelList,
    TokenizeResponse,
)
from qoqserve.server.responses_api import ResponsesServing
from qoqserve.server.responses_protocol import ResponsesRequest
from qoqserve.server.serving import ClientGone, OpenAIServing
from qoqserve.server.tokenization import DetokenizeRequest, TokenizeRequest
from qoqserve.version import __version__

log = logging.getLogger(__name__)

_HTTP_TYPES = {401: "authentication_error", 404: "not_found_error"}


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, e: InvalidRequestError):
        return error_response(APIError(400, str(e), param=e.param, code=e.code))

    @app.exception_handler(QueueFullError)
    async def _full(request: Request, e: QueueFullError):
        # 429, as vLLM's bounded queue answers: the client should back off and retry
        return error_response(APIError(429, str(e), type="rate_limit_error", code="queue_full",
                                       headers={"Retry-After": str(e.retry_after_s)}))

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, e: EngineDeadError):
        return error_response(APIError(503, str(e), type="service_unavailable"))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, e: ClientGone):
        return Response(status_code=499)  # nobody reads it; the request was aborted

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        # 405s carry `Allow`; keep whatever headers the exception has
        return error_response(APIError(e.status_code, str(e.detail),
                                       type=_HTTP_TYPES.get(e.status_code, "invalid_request_error"),
                                       headers=dict(e.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return error_response(from_validation_errors(list(e.errors()), prefix=("body",)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}",
                                       type="server_error"))


def build_app(engine: AsyncEngine, config: ServerConfig, model_names: list[str],
              metrics: ServerMetrics | None = None) -> FastAPI:
    """model_names: the names requests may give; the first is the one answers carry."""
    serving = OpenAIServing(engine, config, model_names)
    responses = ResponsesServing(serving, config.responses_store_size)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # uvicorn has already let in-flight requests finish (or cut them after its
        # graceful timeout); whatever is left is aborted and the engine thread stops
        await asyncio.to_thread(engine.shutdown)

    # strict_content_type off: a JSON body without a Content-Type is still JSON
    app = FastAPI(title="qoqserve", description="OpenAI-compatible W4A8KV4 serving", lifespan=lifespan,
                  docs_url="/docs", redoc_url=None, strict_content_type=False)
    app.add_middleware(GuardMiddleware, config=config)
    # outside the guard: a browser's preflight carries no API key
    app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=config.allowed_methods,
                       allow_headers=config.allowed_headers, allow_credentials=config.allow_credentials)
    _install_error_handlers(app)

    @app.get("/health", response_model=Health,
             responses={503: {"model": ErrorResponse, "description": "the engine is not running"}})
    async def health():
        """200 while the engine runs (`degraded` once a step failed that no single request
        explained; the server still serves), 503 once it has stopped."""
        if not engine.is_alive:
            return error_response(APIError(503, "the engine is not running", type="service_unavailable"))
        return JSONResponse(engine.health())

    @app.get("/version")
    async def version():
        """vLLM's: the server's version."""
        return {"version": __version__}

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": started, "owned_by": "qoqserve",
            "max_model_len": serving.max_model_len} for name in model_names]}

    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS, description=STREAM)
    async def completions(body: CompletionRequest, request: Request):
        return await serving.completion(body, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS,
              description=STREAM)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving.chat(body, request)

    @app.post("/v1/responses", responses=ERRORS, description=STREAM)
    async def create_response(body: ResponsesRequest, request: Request):
        """OpenAI's Responses API (server/responses_api.py says what of it)."""
        return await responses.create(body, request)

    @app.get("/v1/responses/{response_id}", responses=ERRORS)
    async def get_response(response_id: str):
        return responses.get(response_id)

    @app.post("/v1/responses/{response_id}/cancel", responses=ERRORS)
    async def cancel_response(response_id: str):
        return responses.cancel(response_id)

    @app.delete("/v1/responses/{response_id}", responses=ERRORS)
    async def delete_response(response_id: str):
        return responses.delete(response_id)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
    async def tokenize(body: TokenizeRequest):
        """vLLM's: a text (`prompt`) or a conversation (`messages`, through the chat template) as token ids."""
        return tokenization.tokenize(serving, body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
    async def detokenize(body: DetokenizeRequest):
        return tokenization.detokenize(serving, body)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus():
        body = metrics.render() if metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return app
