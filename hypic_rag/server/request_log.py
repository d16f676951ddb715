"""Request ids, and what the service logs when a request goes wrong: one line for a refusal, one record for a bug.

Every HTTP request gets an id (the client's `X-Request-ID` when it sends a usable one, else a fresh one), sent back
in the `X-Request-ID` response header and carried by every log record about the request:
- an expected refusal (any 4xx, a 429, a 503 or 504 the service chose to answer) is one line at INFO, no traceback:
  `request 1f0c...: POST /v1/ask -> 400 recompute_policy: ...`;
- an unexpected error (a bug answered with a 500, or an `error` event of a stream) is one ERROR record with its
  traceback, naming the request id (also in the 500's message, so a client's report finds it).
uvicorn's own "Invalid HTTP request received." (a client sending garbage) keeps its one line, without the parser's
traceback.
"""

from __future__ import annotations

import logging
import re
import uuid
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = b"x-request-id"
_USABLE_ID = re.compile(rb"[A-Za-z0-9._:-]{1,64}")
"""A client's request id is kept when it is short and plain (it goes into log lines and a response header)."""


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What the log says about the request being served."""

    request_id: str
    method: str
    path: str


_CURRENT: ContextVar[RequestInfo | None] = ContextVar("hypic_request", default=None)


def current_request() -> RequestInfo | None:
    """The request this task serves (None outside a request)."""
    return _CURRENT.get()


def current_request_id() -> str:
    info = _CURRENT.get()
    return info.request_id if info is not None else "-"


def _one_line(text: str, limit: int = 500) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else f"{line[: limit - 3]}..."


def _described() -> str:
    info = _CURRENT.get()
    return f"request {info.request_id}: {info.method} {info.path}" if info is not None else "request -"


def log_refusal(status: int, message: str) -> None:
    """One line for a request the service refused on purpose (no traceback)."""
    logger.info("%s -> %d %s", _described(), status, _one_line(message))


def log_unexpected(error: BaseException, what: str = "failed") -> None:
    """One ERROR record, with the traceback, for an error nobody expected while serving the current request."""
    logger.error("%s %s: %s: %s", _described(), what, type(error).__name__, _one_line(str(error), 200),
                 exc_info=error)


class RequestIds:
    """ASGI middleware (outermost): give each HTTP request its id, make it the current request of the task that
    serves it (handlers, streams and their logs), and send it back as `X-Request-ID`."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers", [])).get(REQUEST_ID_HEADER, b"")
        request_id = given.decode() if _USABLE_ID.fullmatch(given) else uuid.uuid4().hex[:16]
        token = _CURRENT.set(RequestInfo(request_id, scope.get("method", ""), scope.get("path", "")))
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REQUEST_ID_HEADER, request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _CURRENT.reset(token)


class OneLineProtocolErrors(logging.Filter):
    """On uvicorn's error logger: "Invalid HTTP request received." (a client sent bytes that are not HTTP) stays one
    line, the parser's exception appended, its traceback dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and str(record.msg).startswith("Invalid HTTP"):
            error = record.exc_info[1]
            record.msg = f"{record.msg} ({type(error).__name__}: {_one_line(str(error), 200)})"
            record.exc_info = None
            record.exc_text = None
        return True


def install_protocol_error_filter() -> None:
    """Put `OneLineProtocolErrors` on uvicorn's error logger (once)."""
    uvicorn_errors = logging.getLogger("uvicorn.error")
    if not any(isinstance(existing, OneLineProtocolErrors) for existing in uvicorn_errors.filters):
        uvicorn_errors.addFilter(OneLineProtocolErrors())
