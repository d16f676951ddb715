"""The hypic-rag REST service (FastAPI): `create_app(ServerConfig(index_dir=...))`, or `hypic-rag serve`.

The public surface, what other packages (`hypic_rag.distributed`) build on: `ServerConfig`, `create_app` (with
`start=True` the model loads now and start-up errors raise here; `app_ready(app)` tells whether it serves, and
`stop_app(app)` stops it), `limit_body_size` and `check_api_keys` (the server's request-size limit and API keys,
for an app of one's own), the error responses a front answers alike (`unreadable_body_response`,
`unavailable_response`), and `WRITE_PREFIXES`, the document routes (a front sends them to the index's owner).
`create_app` is imported on first use, so `ServerConfig` loads without FastAPI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hypic_rag.server.auth import WRITE_PREFIXES
from hypic_rag.server.config import DEFAULT_SEPARATOR, ServerConfig

if TYPE_CHECKING:
    from hypic_rag.server.app import app_ready, check_api_keys, create_app, limit_body_size, stop_app
    from hypic_rag.server.errors import unavailable_response, unreadable_body_response

PUBLIC_FACTORY = ("create_app", "limit_body_size", "check_api_keys", "app_ready", "stop_app")
"""The app factory's names (imported from `hypic_rag.server.app` on first use)."""
PUBLIC_ERRORS = ("unreadable_body_response", "unavailable_response")
"""Error responses (imported from `hypic_rag.server.errors` on first use)."""

__all__ = ["DEFAULT_SEPARATOR", "WRITE_PREFIXES", "ServerConfig", *PUBLIC_FACTORY, *PUBLIC_ERRORS]


def __getattr__(name: str) -> Any:
    if name in PUBLIC_FACTORY:
        from hypic_rag.server import app

        return getattr(app, name)
    if name in PUBLIC_ERRORS:
        from hypic_rag.server import errors

        return getattr(errors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
