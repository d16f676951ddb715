"""The page: `GET /` (a page to ask from, `static/index.html`) and its script and style under `/ui/`.

Static files shipped inside the package (no build step, nothing fetched from elsewhere); the page talks to the
JSON API (`/v1/ask` streamed, `/healthz`, `/v1/cache/stats`, `/v1/documents`, `/v1/jobs/{id}`) like any client.
Everything it serves lies under `/` and `PAGE_PREFIX`, so an authentication rule can exempt exactly those.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().with_name("static")
"""The page's files: index.html, page.js, page.css."""
PAGE_PREFIX = "/ui"
"""Where the page's script and style are served from (`/ui/page.js`)."""
PAGE_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
               "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
"""The page's Content-Security-Policy: only its own script and style run, and it talks only to this server (no
inline script: a document's text shown on the page can never run, even if it were inserted as markup)."""

router = APIRouter(include_in_schema=False)


@router.get("/")
async def page() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html",
                        headers={"Content-Security-Policy": PAGE_POLICY, "Cache-Control": "no-cache"})


def install_page(app: FastAPI) -> None:
    """Serve the page at `/` and its assets under `PAGE_PREFIX`."""
    app.include_router(router)
    app.mount(PAGE_PREFIX, StaticFiles(directory=STATIC_DIR), name="ui")
