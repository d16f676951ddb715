"""`create_app(config)`: the FastAPI application of the hypic-rag service.

    from hypic_rag.server import ServerConfig, create_app
    app = create_app(ServerConfig(index_dir="index/"))   # serve with uvicorn; the model loads at startup

Startup builds the backend (model, index, segment cache) inside the model worker thread; shutdown lets the
running request finish (up to `shutdown_grace_s`), fails queued ones with 503, stops document jobs between
steps and closes the cache and index from the worker thread, so nothing is left half-written.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from html import escape
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from hypic_rag.version import __version__
from hypic_rag.server import routes_admin, routes_ask, routes_chat, routes_completions, routes_documents
from hypic_rag.server.backend import ServiceBackend
from hypic_rag.server.config import ServerConfig
from hypic_rag.server.errors import install_error_handlers
from hypic_rag.server.middleware import ApiKeyCheck, BodySizeLimit, RequestMetrics, UnexpectedErrors
from hypic_rag.server.request_log import RequestIds
from hypic_rag.server.routes_page import install_page
from hypic_rag.server.service import Service

logger = logging.getLogger(__name__)

DESCRIPTION = (
    "Question answering over a corpus whose chunks are pre-encoded into a persistent segment cache: retrieved "
    "chunks' cached states are composed and only seams and the question are recomputed. `/v1/completions` is "
    "OpenAI-compatible; separate prompt segments with the separator (default `<<PIC_SEP>>`) to reuse them."
)


def create_app(config: ServerConfig, *, service: Service | None = None, start: bool = False) -> FastAPI:
    """The application for `config`; its lifespan starts (unless `service` was started already, as `serve`
    does so that start-up errors surface before uvicorn runs) and stops the model worker. start: start the
    service now (loads the model; its errors raise here), for a caller that serves the app without its lifespan
    (a Ray Serve replica: then `stop_app` stops it)."""
    if service is None:
        service = Service(config, lambda: ServiceBackend.open(config))
    if start and not service.started:
        service.start()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not service.started:
            await asyncio.to_thread(service.start)
        logger.info("hypic-rag service ready (index %s)", config.index_dir)
        try:
            yield
        finally:
            logger.info("hypic-rag service shutting down")
            await asyncio.to_thread(service.stop)

    # Swagger UI would load its scripts from a CDN (blank offline): /docs is a local page built from the schema
    app = FastAPI(title="hypic-rag", version=__version__, description=DESCRIPTION, lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.service = service

    @app.get("/docs", include_in_schema=False, response_class=HTMLResponse)
    async def docs() -> HTMLResponse:
        return HTMLResponse(docs_page(app.openapi()))

    install_error_handlers(app)
    if config.page:
        install_page(app)
    for module in (routes_ask, routes_completions, routes_chat, routes_documents, routes_admin):
        app.include_router(module.router)
    limit_body_size(app, config)
    check_api_keys(app, config)
    app.add_middleware(RequestMetrics, metrics=service.metrics)
    app.add_middleware(UnexpectedErrors)  # RequestMetrics counts its 500s
    app.add_middleware(RequestIds)  # outermost: every log record of a request, its 500 included, names its id
    return app


def limit_body_size(app: FastAPI, config: ServerConfig) -> None:
    """Refuse request bodies over `config.max_body_bytes` with the server's 413 (before they are read whole)."""
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)


def check_api_keys(app: FastAPI, config: ServerConfig) -> None:
    """Refuse requests without the key their route needs (`hypic_rag.server.auth`), before their body is read
    (added after `limit_body_size`, so it runs first); nothing when no key is set."""
    if config.keys.enabled:
        app.add_middleware(ApiKeyCheck, keys=config.keys)


def app_ready(app: FastAPI) -> bool:
    """Whether the app's model worker is ready to serve (started, not stopping)."""
    return bool(app.state.service.worker.ready)


def stop_app(app: FastAPI) -> None:
    """Stop the app's service (as its lifespan's end does): running requests may finish, the cache is closed."""
    app.state.service.stop()


def docs_page(schema: dict[str, Any]) -> str:
    """A self-contained HTML page (no script, no external asset) listing every endpoint of `schema` with its
    summary; the full OpenAPI schema is linked at /openapi.json (load it into any OpenAPI viewer)."""
    rows = []
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            summary = operation.get("summary") or operation.get("description", "").split("\n")[0]
            rows.append(f"<tr><td><code>{escape(method.upper())}</code></td><td><code>{escape(path)}</code></td>"
                        f"<td>{escape(summary)}</td></tr>")
    info = schema.get("info", {})
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{escape(info.get('title', 'API'))} API</title>"
        "<style>body{font-family:sans-serif;margin:2em}td{padding:.2em .8em;border-bottom:1px solid #ddd}</style>"
        f"</head><body><h1>{escape(info.get('title', 'API'))} {escape(str(info.get('version', '')))}</h1>"
        f"<p>{escape(info.get('description', ''))}</p>"
        "<p>OpenAPI schema: <a href='/openapi.json'>/openapi.json</a></p>"
        f"<table>{''.join(rows)}</table></body></html>"
    )
