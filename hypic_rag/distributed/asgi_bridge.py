"""One HTTP request run through an in-process ASGI application, its response streamed back in parts.

A replica of `serve --replicas N` runs the service's own FastAPI application (every route, limit, error shape and
stream of the single-process server) without a socket: the front sends it a `ForwardedRequest`, and
`stream_asgi` yields the response's start (`ResponseStart`: status and headers) and then its body as it is
produced, so server-sent events reach the client token by token. Closing the stream early (the client went away)
tells the application the client disconnected, which stops the request in the model worker as it would on a
socket. Plain asyncio, no Ray: the tests drive it directly too.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

_DONE = object()


@dataclass(frozen=True, slots=True)
class ForwardedRequest:
    """An HTTP request as the front received it: method, path (percent-decoded), raw query string, headers
    (lower-case names, as bytes), the whole body, the client's address, and the path as the client wrote it
    (`raw_path`, percent-encoded; empty when not known: `path` encoded stands for it)."""

    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    client: tuple[str, int] = ("127.0.0.1", 0)
    raw_path: bytes = b""

    def header(self, name: str) -> str | None:
        wanted = name.lower().encode("latin-1")
        return next((value.decode("latin-1") for key, value in self.headers if key == wanted), None)


@dataclass(frozen=True, slots=True)
class ResponseStart:
    """The start of a response: its status and headers (names and values as bytes)."""

    status: int
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


def _scope(request: ForwardedRequest) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method.upper(),
        "scheme": "http",
        "path": request.path,
        "raw_path": request.raw_path or request.path.encode("utf-8"),
        "root_path": "",
        "query_string": request.query_string,
        "headers": [(key, value) for key, value in request.headers],
        "client": request.client,
        "server": ("127.0.0.1", 0),
        "state": {},
    }


def internal_error(message: str) -> tuple[ResponseStart, bytes]:
    """The service's 500 shape, for an application that failed before it could answer."""
    body = json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": "internal_error"}})
    return ResponseStart(500, [(b"content-type", b"application/json")]), body.encode()


async def stream_asgi(app: Any, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
    """Run `request` through the ASGI `app`: yields one `ResponseStart`, then the body's non-empty parts.

    The request body is delivered at once; after it, the application's `receive` waits until this stream is closed
    (the consumer went away, or the response ended), then reports `http.disconnect`."""
    messages: asyncio.Queue[Any] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal body_delivered
        if not body_delivered:
            body_delivered = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(_scope(request), receive, send)
        except Exception as error:  # reported as a 500 if nothing was sent yet
            logger.exception("the application failed on %s %s", request.method, request.path)
            await messages.put(error)
        finally:
            await messages.put(_DONE)

    task = asyncio.get_running_loop().create_task(run())
    started = False
    try:
        while True:
            message = await messages.get()
            if message is _DONE or isinstance(message, Exception):
                if not started:
                    start, body = internal_error(f"the replica's application failed: {message!r}"[:300])
                    yield start
                    yield body
                return
            if message["type"] == "http.response.start":
                started = True
                yield ResponseStart(int(message["status"]), [(bytes(k), bytes(v)) for k, v in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                chunk = bytes(message.get("body", b""))
                if chunk:
                    yield chunk
                if not message.get("more_body", False):
                    return
    finally:
        disconnected.set()  # ended, or closed early: the application sees the client go
        if not task.done():
            task.add_done_callback(lambda done: done.cancelled() or done.exception())
