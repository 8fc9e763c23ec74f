"""The HTTP layer: routes, auth, body limits and error shapes over OpenAIServing."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from qoqserve.errors import InvalidRequestError
from qoqserve.server.async_engine import AsyncEngine, EngineDeadError
from qoqserve.server.config import ServerConfig
from qoqserve.server.metrics import ServerMetrics
from qoqserve.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse,
)
from qoqserve.server.serving import ClientGone, OpenAIServing

log = logging.getLogger(__name__)


class BodyTooLarge(APIError):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than {limit} bytes", code="body_too_large")


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class GuardMiddleware:
    """API key on /v1/*, and the body-size limit, before any handler runs.
    Plain ASGI (not BaseHTTPMiddleware) so streaming and disconnects pass through untouched."""

    def __init__(self, app, config: ServerConfig):
        self.app = app
        self.config = config

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key = self.config.api_key
        if key and scope["path"].startswith("/v1"):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
                err = APIError(401, "invalid or missing API key; send 'Authorization: Bearer <key>'",
                               type="authentication_error", code="invalid_api_key")
                return await error_response(err)(scope, receive, send)
        limit = self.config.max_body_bytes
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await error_response(BodyTooLarge(limit))(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > limit:  # chunked bodies carry no content-length
                    raise BodyTooLarge(limit)
            return msg

        await self.app(scope, limited_receive, send)


async def _json_body(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


def build_app(engine: AsyncEngine, config: ServerConfig, model_name: str,
              metrics: ServerMetrics | None = None) -> FastAPI:
    serving = OpenAIServing(engine, config, model_name)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # uvicorn has already let in-flight requests finish (or cut them after its
        # graceful timeout); whatever is left is aborted and the engine thread stops
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="qoqserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(GuardMiddleware, config=config)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, e: InvalidRequestError):
        return error_response(APIError(400, str(e), param=e.param, code=e.code))

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, e: EngineDeadError):
        return error_response(APIError(503, str(e), type="service_unavailable"))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, e: ClientGone):
        return Response(status_code=499)  # nobody reads it; the request was aborted

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(APIError(e.status_code, str(e.detail), type=kind))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return error_response(APIError(400, str(e)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}",
                                       type="server_error"))

    @app.get("/health")
    async def health():
        if not engine.is_alive:
            return error_response(APIError(503, "the engine is not running", type="service_unavailable"))
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": started, "owned_by": "qoqserve",
            "max_model_len": serving.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serving.completion(parse(CompletionRequest, await _json_body(request)), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serving.chat(parse(ChatCompletionRequest, await _json_body(request)), request)

    @app.get("/metrics")
    async def prometheus():
        body = metrics.render() if metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return app

