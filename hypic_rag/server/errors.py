"""Errors the service answers with, and the handlers that turn every failure into one JSON shape.

Every error body is OpenAI's: ``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``. `type` is
the class of error as OpenAI names it (`invalid_request_error` for anything wrong with the request, whatever its
status; `rate_limit_error` when the queue is full; `server_error` for the server's own failures), `code` a string
naming the error (`model_not_found`, `not_found`, `invalid_type`, `invalid_value`, `payload_too_large`,
`queue_full`, `timeout`, ...; `ERROR_CODES`), `param` the field at fault or null; the HTTP status is the
response's. Validation errors also list each bad field under ``error.fields``. A field of the wrong type is a 400
on every route (as OpenAI's and vLLM's servers answer); any other invalid field is a 422 on hypic-rag's own routes
and a 400 on OpenAI's. A number out of its range is answered with the range: "top_k: must be an integer in
1..256, got 0".
"""

from __future__ import annotations

import logging
from typing import Any

import annotated_types
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from hypic_rag.errors import HypicError
from hypic_rag.utils.limits import NumberRange
from hypic_rag.server.request_log import current_request_id, log_refusal

logger = logging.getLogger(__name__)


INVALID_REQUEST = "invalid_request_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"


class ServiceError(HypicError):
    """A request the service refuses or cannot finish; `status` is the HTTP status code, `error_type` and `code`
    the body's `type` and `code` (answered as JSON by the handlers below; it never reaches the command line)."""

    status = 500
    error_type = SERVER_ERROR
    code = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.code, self.param)


class BadRequestError(ServiceError):
    status, error_type, code = 400, INVALID_REQUEST, "invalid_value"


class NotFoundError(ServiceError):
    status, error_type, code = 404, INVALID_REQUEST, "not_found"


class ModelNotFoundError(NotFoundError):
    """A `model` other than the served one (OpenAI's and vLLM's 404)."""

    code = "model_not_found"


class ConflictError(ServiceError):
    status, error_type, code = 409, INVALID_REQUEST, "conflict"


class PayloadTooLargeError(ServiceError):
    status, error_type, code = 413, INVALID_REQUEST, "payload_too_large"


class QueueFullError(ServiceError):
    status, error_type, code = 429, RATE_LIMIT, "queue_full"


class ServiceUnavailableError(ServiceError):
    status, error_type, code = 503, SERVER_ERROR, "unavailable"


class RequestTimeoutError(ServiceError):
    status, error_type, code = 504, SERVER_ERROR, "timeout"


class UnprocessableError(ServiceError):
    """A field is out of the range this server accepts (the bound depends on its settings)."""

    status, error_type, code = 422, INVALID_REQUEST, "invalid_value"


class RequestCancelledError(ServiceError):
    """The request was cancelled (its client went away) before the worker finished it."""

    status, error_type, code = 499, INVALID_REQUEST, "cancelled"


ERROR_CODES = {
    "invalid_type": "a field of the wrong JSON type (400)",
    "invalid_value": "a field with a value it cannot take: empty, unknown, out of range (400 or 422)",
    "invalid_json": "a body that is not UTF-8 JSON (400)",
    "missing_api_key": "no 'Authorization: Bearer <key>' header on a server started with a key (401)",
    "invalid_api_key": "a key the server does not know (401)",
    "permission_denied": "a document change with a key that may only read (403)",
    "model_not_found": "a model other than the served one (404)",
    "not_found": "an unknown job, document or path (404)",
    "method_not_allowed": "a method the path does not take (405)",
    "conflict": "a document change on a read-only server (409)",
    "payload_too_large": "a body, question, prompt or document over the server's limits (413)",
    "cancelled": "the client went away first (499)",
    "queue_full": "the request queue is full (429)",
    "unavailable": "starting or shutting down (503)",
    "timeout": "the request's deadline passed (504)",
    "internal_error": "a bug (500)",
}
"""Every `code` an error body carries, and when."""


def error_body(message: str, error_type: str, code: str | None, param: str | None = None,
               **extra: Any) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code, **extra}}


def internal_error_body(error: BaseException) -> dict[str, Any]:
    """The body of a 500: the exception's type and the request id (the traceback goes to the log, under that id)."""
    return error_body(f"internal error: {type(error).__name__} (request {current_request_id()})", SERVER_ERROR,
                      "internal_error")


def unreadable_body_response(cause: ValueError | RecursionError) -> JSONResponse:
    """The 400 ``invalid_json`` of a body that cannot be read as JSON (`cause`: what `json.loads` raised), logged as
    one line; the single server and the `--workers` front answer it alike."""
    reason = " ".join(str(cause).split())[:200]
    message = f"body: not readable as UTF-8 JSON ({reason})"
    log_refusal(400, message)
    return JSONResponse(error_body(message, INVALID_REQUEST, "invalid_json", "body"), status_code=400)


def unavailable_response(message: str, retry_after_s: int = 1) -> JSONResponse:
    """503 ``unavailable`` with `Retry-After` (not logged: the caller logs the change that causes it, once)."""
    return JSONResponse(error_body(message, SERVER_ERROR, "unavailable"), status_code=503,
                        headers={"Retry-After": str(retry_after_s)})


def error_response(error: ServiceError) -> JSONResponse:
    """The JSON response of a refusal, logged as one line."""
    log_refusal(error.status, error.message)
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


RANGE_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"})
"""pydantic's error types of a number outside its range."""


def is_type_error(item: dict[str, Any]) -> bool:
    """Whether a pydantic error says the value has the wrong JSON type (a string for a boolean, `true` or `1.5` for
    an integer, an object for a string), not a wrong value of the right type."""
    kind = str(item.get("type", ""))
    return kind.endswith(("_type", "_parsing")) or kind in ("int_from_float", "is_instance_of")


def _field_at(model: Any, location: tuple[Any, ...] | list[Any]) -> Any:
    """The pydantic `FieldInfo` at `location` (("body", "top_k"), ("body", "stream_options", "include_usage")) of
    the body `model`, or None (inside a list, a union, a dict)."""
    parts = [part for part in location if part not in ("body",)]
    field = None
    for part in parts:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        field = model.model_fields[part]
        model = field.annotation
    return field


def stated_range(field: Any) -> NumberRange | None:
    """The range a numeric field's constraints state (ge / gt / le / lt), when it has both ends."""
    if field is None:
        return None
    bounds: dict[str, Any] = {}
    for constraint in field.metadata:
        for name in ("ge", "gt", "le", "lt"):
            if isinstance(constraint, getattr(annotated_types, name.capitalize())):
                bounds[name] = getattr(constraint, name)
    low, high = bounds.get("ge", bounds.get("gt")), bounds.get("le", bounds.get("lt"))
    if low is None or high is None:
        return None
    integer = "int" in str(field.annotation) and "float" not in str(field.annotation)
    return NumberRange(low, high, integer=integer, minimum_exclusive="gt" in bounds)


def _field_error(item: dict[str, Any], body_model: Any = None) -> dict[str, str]:
    if item.get("type") == "json_invalid":  # located at a character offset of the body, not at a field
        location = item.get("loc", ())
        offset = location[-1] if location and isinstance(location[-1], int) else "?"
        reason = (item.get("ctx") or {}).get("error", "malformed")
        return {"field": "body", "message": f"invalid JSON at character {offset} ({reason})"}
    field_name = _field_name(item.get("loc", ()))
    message = str(item.get("msg", "invalid"))
    if item.get("type") in RANGE_ERRORS or is_type_error(item):
        allowed = stated_range(_field_at(body_model, item.get("loc", ())))
        if allowed is not None:
            problem = allowed.problem(item.get("input"))
            message = problem if problem is not None else message
    return {"field": field_name, "message": message}


def _body_model(request: Request) -> Any:
    """The pydantic model of the route's JSON body, if it has one."""
    route = request.scope.get("route")
    for parameter in getattr(getattr(route, "dependant", None), "body_params", ()):
        annotation = getattr(getattr(parameter, "field_info", None), "annotation", None)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return annotation
    return None


OPENAI_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
"""Routes of OpenAI's API: an invalid field there is a 400 (`invalid_request_error`), as vLLM answers, so the
official client raises `BadRequestError`; elsewhere it is a 422."""


def validation_response(error: RequestValidationError, status: int = 422, body_model: Any = None) -> JSONResponse:
    """`status` (422; 400 when a field has the wrong type) naming every bad field: `message` reads "top_k: must be
    an integer in 1..256, got 0" (the range of `body_model`'s field, when it states one)."""
    items = error.errors()
    if any(is_type_error(item) for item in items):
        status = 400
    fields = [_field_error(item, body_model) for item in items]
    message = "; ".join(f"{item['field']}: {item['message']}" for item in fields) or "invalid request"
    param = fields[0]["field"] if fields else None
    if any(item.get("type") == "json_invalid" for item in items):
        code = "invalid_json"
    else:
        code = "invalid_type" if any(is_type_error(item) for item in items) else "invalid_value"
    log_refusal(status, message)
    return JSONResponse(error_body(message, INVALID_REQUEST, code, param, fields=fields), status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves the service in the JSON shape above, never as a bare traceback.

    Exceptions no handler takes are answered by the `UnexpectedErrors` middleware (a JSON 500 that keeps the
    connection open), not by a handler here: Starlette re-raises after its own 500, and uvicorn then drops the
    kept-alive connection without `Connection: close`.
    """

    async def on_service_error(request: Request, error: ServiceError) -> JSONResponse:
        return error_response(error)

    async def on_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return validation_response(error, 400 if request.url.path in OPENAI_PATHS else 422, _body_model(request))

    async def on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http_error")
        error_type = SERVER_ERROR if error.status_code >= 500 else INVALID_REQUEST
        if error.status_code == 400 and isinstance(error.__cause__, (ValueError, RecursionError)):
            # FastAPI could not read the body as JSON: not UTF-8 (UnicodeDecodeError), a number of thousands of
            # digits, arrays nested thousands deep
            return unreadable_body_response(error.__cause__)
        log_refusal(error.status_code, str(error.detail))
        return JSONResponse(
            error_body(str(error.detail), error_type, code),
            status_code=error.status_code,
            headers=getattr(error, "headers", None),
        )

    app.add_exception_handler(ServiceError, on_service_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http_error)  # type: ignore[arg-type]
