"""Server-sent events framing: `data: {json}\n\n` per event and a final `data: [DONE]\n\n`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: Any) -> str:
    """One event carrying `payload` as JSON on a single data line."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    """A `text/event-stream` response that relays `events` (already framed) as they come."""
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
