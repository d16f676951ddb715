"""Errors the service answers with, and the handlers that turn every failure into one JSON shape.

Every error body is OpenAI-style: ``{"error": {"message": ..., "type": ..., "param": ..., "code": <status>}}``;
validation errors also list each bad field under ``error.fields``.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hypic_rag.errors import HypicError

logger = logging.getLogger(__name__)


class ServiceError(HypicError):
    """A request the service refuses or cannot finish; `status` is the HTTP status code (answered as JSON by the
    handlers below; it never reaches the command line)."""

    status = 500
    kind = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.status, self.param)


class BadRequestError(ServiceError):
    status, kind = 400, "invalid_request_error"


class NotFoundError(ServiceError):
    status, kind = 404, "not_found"


class ConflictError(ServiceError):
    status, kind = 409, "conflict"


class PayloadTooLargeError(ServiceError):
    status, kind = 413, "payload_too_large"


class QueueFullError(ServiceError):
    status, kind = 429, "queue_full"


class ServiceUnavailableError(ServiceError):
    status, kind = 503, "unavailable"


class RequestTimeoutError(ServiceError):
    status, kind = 504, "timeout"


class UnprocessableError(ServiceError):
    """A field is out of the range this server accepts (the bound depends on its settings)."""

    status, kind = 422, "validation_error"


class RequestCancelledError(ServiceError):
    """The request was cancelled (its client went away) before the worker finished it."""

    status, kind = 499, "cancelled"


def error_body(message: str, kind: str, status: int, param: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status, **extra}}


def internal_error_body(error: BaseException) -> dict[str, Any]:
    """The body of a 500: the exception's type only (the traceback goes to the log)."""
    return error_body(f"internal error: {type(error).__name__}", "internal_error", 500)


def error_response(error: ServiceError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _field_name(location: tuple[Any, ...] | list[Any]) -> str:
    """("body", "documents", 0, "text") -> "documents[0].text"; the leading "body"/"query"/"path" is dropped."""
    parts = list(location)
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    name = ""
    for part in parts:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name or "body"


def _field_error(item: dict[str, Any]) -> dict[str, str]:
    if item.get("type") == "json_invalid":  # located at a character offset of the body, not at a field
        location = item.get("loc", ())
        offset = location[-1] if location and isinstance(location[-1], int) else "?"
        reason = (item.get("ctx") or {}).get("error", "malformed")
        return {"field": "body", "message": f"invalid JSON at character {offset} ({reason})"}
    return {"field": _field_name(item.get("loc", ())), "message": str(item.get("msg", "invalid"))}


OPENAI_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
"""Routes of OpenAI's API: an invalid field there is a 400 (`invalid_request_error`), as vLLM answers, so the
official client raises `BadRequestError`; elsewhere it is a 422."""


def validation_response(error: RequestValidationError, status: int = 422) -> JSONResponse:
    """`status` (422) naming every bad field: `message` reads "top_k: Input should be greater than or equal to 1"."""
    fields = [_field_error(item) for item in error.errors()]
    message = "; ".join(f"{item['field']}: {item['message']}" for item in fields) or "invalid request"
    param = fields[0]["field"] if fields else None
    kind = "invalid_request_error" if status == 400 else "validation_error"
    return JSONResponse(error_body(message, kind, status, param, fields=fields), status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves the service in the JSON shape above, never as a bare traceback.

    Exceptions no handler takes are answered by the `UnexpectedErrors` middleware (a JSON 500 that keeps the
    connection open), not by a handler here: Starlette re-raises after its own 500, and uvicorn then drops the
    kept-alive connection without `Connection: close`.
    """

    async def on_service_error(request: Request, error: ServiceError) -> JSONResponse:
        return error_response(error)

    async def on_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return validation_response(error, 400 if request.url.path in OPENAI_PATHS else 422)

    async def on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http_error")
        return JSONResponse(
            error_body(str(error.detail), kind, error.status_code),
            status_code=error.status_code,
            headers=getattr(error, "headers", None),
        )

    app.add_exception_handler(ServiceError, on_service_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http_error)  # type: ignore[arg-type]
