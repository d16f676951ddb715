"""ASGI middleware: API keys (401 / 403, `auth.py`), a request-body size limit (413), per-request metrics (status, duration), and a JSON 500 for
exceptions no handler took that leaves the kept-alive connection usable."""

from __future__ import annotations

import json
import time
from typing import Any

from hypic_rag.server.auth import ApiKeys
from hypic_rag.server.errors import INVALID_REQUEST, PayloadTooLargeError, error_body, internal_error_body
from hypic_rag.server.metrics import ServiceMetrics
from hypic_rag.server.request_log import log_refusal, log_unexpected


Scope = dict[str, Any]
Message = dict[str, Any]


async def send_json(send: Any, status: int, body: dict[str, Any],
                    headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """Answer an ASGI request with `status` and the JSON `body` (plus `headers`)."""
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                        *headers],
        }
    )
    await send({"type": "http.response.body", "body": payload})


class BodySizeLimit:
    """Refuse request bodies over `max_bytes` with 413: from Content-Length up front; a body without one
    (chunked) is read up to the limit before the app sees it, then replayed."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _refuse(self, send: Any) -> None:
        message = f"request body exceeds {self.max_bytes} bytes"
        log_refusal(413, message)
        body = PayloadTooLargeError(message, param="body").body()
        await send_json(send, 413, body)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        if b"content-length" in headers:
            try:
                declared = int(headers[b"content-length"])
            except ValueError:
                declared = 0
            if declared > self.max_bytes:
                await self._refuse(send)
                return
            await self.app(scope, receive, send)
            return
        if b"transfer-encoding" not in headers:
            await self.app(scope, receive, send)  # no body
            return
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away while sending
            part = message.get("body", b"")
            size += len(part)
            if size > self.max_bytes:
                await self._refuse(send)
                return
            parts.append(part)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(parts), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class RequestMetrics:
    """Count every response by route template, method and status, and time it to its last byte."""

    def __init__(self, app: Any, metrics: ServiceMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        status = 500

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(template, scope.get("method", ""), str(status)).inc()
            self.metrics.duration.labels(template).observe(time.perf_counter() - began)
            if status == 429:
                self.metrics.rejections.inc()


class UnexpectedErrors:
    """Answer an exception that reached no handler with the JSON 500 of `internal_error_body`, logged once with its
    traceback and request id (`request_log.log_unexpected`), and return normally so that uvicorn keeps the connection open for the client's next request.

    (Starlette's own last resort sends its 500 and then re-raises; uvicorn then closes the kept-alive connection
    without `Connection: close`, and a client that reuses it gets a reset.) An exception after the response
    started cannot be answered any more: it is re-raised, and the connection closes as it must.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as error:
            log_unexpected(error)
            if started:
                raise
            await send_json(send, 500, internal_error_body(error))


class ApiKeyCheck:
    """ASGI middleware: refuse requests without the key their route needs (`ApiKeys.refusal`) with the service's
    JSON error body (401 ``missing_api_key`` / ``invalid_api_key``, 403 ``permission_denied``; a 401 carries
    ``WWW-Authenticate: Bearer``), before the body is read."""

    def __init__(self, app: Any, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.keys.enabled:
            await self.app(scope, receive, send)
            return
        authorization = next((value.decode("latin-1") for name, value in scope.get("headers", [])
                              if name == b"authorization"), None)
        refused = self.keys.refusal(scope.get("method", "GET"), scope.get("path", "/"), authorization)
        if refused is None:
            await self.app(scope, receive, send)
            return
        status, code, message = refused
        log_refusal(status, message)
        headers = ((b"www-authenticate", b"Bearer"),) if status == 401 else ()
        await send_json(send, status, error_body(message, INVALID_REQUEST, code), headers)
