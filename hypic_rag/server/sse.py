"""Server-sent events: framing (`data: {json}\n\n` per event, a final `data: [DONE]\n\n`) and `relay`, the one
loop every streaming route answers with.

A route describes its stream's shape as a `StreamFraming` (what opens the stream, the frames of each event, what
closes it once the result is in, how an error reads); `relay` reads the request's `EventChannel` and frames it.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol, TypeVar

from fastapi.responses import StreamingResponse

from hypic_rag.server.channel import EventChannel
from hypic_rag.server.events import Event, TextEvent
from hypic_rag.server.errors import ServiceError, internal_error_body
from hypic_rag.server.request_log import log_refusal, log_unexpected

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

R = TypeVar("R", contravariant=True)
Frames = list[dict[str, Any]]


def sse_event(payload: Any) -> str:
    """One event carrying `payload` as JSON on a single data line."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    """A `text/event-stream` response that relays `events` (already framed) as they come."""
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


class StreamFraming(Protocol[R]):
    """How one route frames its stream (payloads; `relay` writes them as events)."""

    def opening(self) -> Frames:
        """Frames sent before any event (e.g. chat's role chunks)."""
        ...

    def event(self, event: Event) -> Frames:
        """Frames of one event of the channel."""
        ...

    def closing(self, result: R, first_token_seconds: float) -> Frames:
        """Frames once the result is in; `first_token_seconds`: from receiving the request to its first text."""
        ...

    def error(self, body: dict[str, Any]) -> dict[str, Any]:
        """The frame of an error that happened after the stream started (`body`: the error's JSON body)."""
        ...


async def relay(channel: EventChannel[Any], framing: StreamFraming[Any], received: float) -> AsyncIterator[str]:
    """The SSE frames of a request: `framing`'s opening, its frames of every event, its closing (or an error
    frame), then [DONE]. received: when the request arrived (perf_counter), for its time to first token."""
    first_text_at: float | None = None
    for payload in framing.opening():
        yield sse_event(payload)
    try:
        async for event in channel.events():
            if first_text_at is None and isinstance(event, TextEvent):
                first_text_at = time.perf_counter()
            for payload in framing.event(event):
                yield sse_event(payload)
        result = channel.outcome()
        for payload in framing.closing(result, (first_text_at or time.perf_counter()) - received):
            yield sse_event(payload)
    except ServiceError as error:
        log_refusal(error.status, error.message)
        yield sse_event(framing.error(error.body()))
    except Exception as error:
        log_unexpected(error, "failed in its stream")
        yield sse_event(framing.error(internal_error_body(error)))
    yield DONE


def stream_response(channel: EventChannel[Any], framing: StreamFraming[Any], received: float) -> StreamingResponse:
    """The `text/event-stream` response relaying `channel` framed by `framing`."""
    return sse_response(relay(channel, framing, received))
