"""The hypic-rag REST service (FastAPI): `create_app(ServerConfig(index_dir=...))`, or `hypic-rag serve`.

`create_app` is imported on first use, so `ServerConfig` loads without FastAPI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hypic_rag.server.config import DEFAULT_SEPARATOR, ServerConfig

if TYPE_CHECKING:
    from hypic_rag.server.app import create_app

__all__ = ["DEFAULT_SEPARATOR", "ServerConfig", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from hypic_rag.server.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
