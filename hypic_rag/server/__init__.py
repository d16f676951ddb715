"""The hypic-rag REST service (FastAPI): `create_app(ServerConfig(index_dir=...))`, or `hypic-rag serve`."""

from __future__ import annotations

from hypic_rag.server.app import create_app
from hypic_rag.server.config import DEFAULT_SEPARATOR, ServerConfig

__all__ = ["DEFAULT_SEPARATOR", "ServerConfig", "create_app"]
