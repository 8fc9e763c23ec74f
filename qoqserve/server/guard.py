"""What every request passes before any handler runs: the API key on /v1/*,
and the body-size limit.

Plain ASGI (not BaseHTTPMiddleware) so streaming and disconnects pass
through untouched. A body over the limit gets a 413 JSON error without
being read: at once when Content-Length says so, or as soon as a chunked
body's bytes pass the limit; the handler then sees the client as gone and
whatever it would have sent is dropped.
"""
from __future__ import annotations

import hmac

from qoqserve.server.config import ServerConfig
from qoqserve.server.protocol import APIError, error_response


class BodyTooLarge(APIError):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than {limit} bytes (the server's "
                         "--max-body-bytes)", code="body_too_large")


class GuardMiddleware:
    def __init__(self, app, config: ServerConfig):
        self.app = app
        self.config = config

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key = self.config.api_key
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):  # uvicorn's path holds --root-path's prefix
            path = path[len(root):]
        if key and path.startswith("/v1"):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
                err = APIError(401, "invalid or missing API key; send 'Authorization: Bearer <key>'",
                               type="authentication_error", code="invalid_api_key")
                return await error_response(err)(scope, receive, send)
        limit = self.config.max_body_bytes
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await error_response(BodyTooLarge(limit))(scope, receive, send)
        received, refused, started = 0, False, False

        async def limited_receive():
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > limit:  # chunked bodies carry no content-length
                    refused = True
                    if not started:
                        await error_response(BodyTooLarge(limit))(scope, receive, send)
                    return {"type": "http.disconnect"}
            return msg

        async def guarded_send(msg):
            nonlocal started
            if refused:  # the 413 went out instead
                return
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        await self.app(scope, limited_receive, guarded_send)
