"""`POST /v1/ask`: retrieve, compose the chunks' cached segments, generate; JSON or server-sent events."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from hypic_rag.pipeline import Answer, Source
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.server.deferred import Deferred
from hypic_rag.server.errors import ServiceError, internal_error_body
from hypic_rag.server.schemas import AskRequest, AskResponse, AskTimings, SourceOut, Usage
from hypic_rag.server.service import EventStream, Service, ServiceDep
from hypic_rag.server.request_log import log_refusal, log_unexpected
from hypic_rag.server.sse import DONE, sse_event, sse_response
from hypic_rag.server.validation import checked_at_most, checked_mode, checked_question, checked_recompute_policy
from hypic_rag.server.worker import TaskContext
from hypic_rag.vocabulary import source_record


ROUTE = "/v1/ask"
router = APIRouter(tags=["answering"])

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "Empty question, unknown mode or recompute policy."},
    413: {"description": "Question or body too large."},
    422: {"description": "A field is missing or out of range (the message names it)."},
    429: {"description": "The request queue is full; see Retry-After."},
    503: {"description": "The server is starting or shutting down."},
    504: {"description": "The request's deadline passed."},
}


def source_out(source: Source, rank: int) -> SourceOut:
    return SourceOut(**source_record(source, rank))


def ask_timings(answer: Answer, queue_seconds: float) -> AskTimings:
    """Milliseconds; time to first token and total include the queue wait. queue_ms: queued for the model worker
    plus waiting for admission to the batch."""
    timings = answer.timings

    def ms(seconds: float) -> float:
        return round(seconds * 1000.0, 3)

    return AskTimings(
        queue_ms=ms(queue_seconds + timings.get("waiting", 0.0)),
        retrieval_ms=ms(timings.get("retrieval", 0.0)),
        cache_load_ms=ms(timings.get("cache_load", 0.0)),
        encode_ms=ms(timings.get("encode", 0.0)),
        compose_ms=ms(timings.get("compose", 0.0)),
        prefill_ms=ms(timings.get("prefill", 0.0)),
        time_to_first_token_ms=ms(queue_seconds + timings.get("time_to_first_token", 0.0)),
        total_ms=ms(queue_seconds + timings.get("total", 0.0)),
    )


def ask_response(answer: Answer, queue_seconds: float) -> AskResponse:
    return AskResponse(
        answer=answer.text,
        sources=[source_out(source, rank) for rank, source in enumerate(answer.sources, start=1)],
        mode=answer.mode,
        recompute_policy=answer.recompute_policy,
        finish_reason=answer.finish_reason,
        usage=Usage(**answer.usage),
        timings=ask_timings(answer, queue_seconds),
        note=answer.note,
    )


@router.post("/v1/ask", response_model=AskResponse, responses=ERROR_RESPONSES, summary="Answer a question")
async def ask(body: AskRequest, request: Request, service: ServiceDep) -> Any:
    """Retrieve `top_k` chunks, assemble their cached segments under `mode`, generate the answer.

    With `stream: true` the answer comes as server-sent events: one `sources` event, `token` events, a `done`
    event (usage and timings), then `data: [DONE]`; an error after the stream started is an `error` event.
    """
    config = service.config
    question = checked_question(body.question, config)
    mode = checked_mode(body.mode)
    backend = service.backend
    policy = checked_recompute_policy(body.recompute_policy, backend.entry_seams, backend.counts.longest_chunk)
    checked_at_most("top_k", body.top_k, config.max_top_k)
    checked_at_most("max_new_tokens", body.max_new_tokens, config.max_new_tokens)
    sampling = {"max_new_tokens": body.max_new_tokens, "temperature": body.temperature, "top_p": body.top_p,
                "seed": body.seed}
    top_k = body.top_k

    def run(backend: Any, context: TaskContext) -> Deferred[Answer]:
        params = SamplingParams(stop_strings=(backend.pipeline.prompt_format.answer_stop,), **sampling)
        return backend.ask(question, top_k=top_k, mode=mode, params=params, context=context, policy=policy)

    timeout_s = service.timeout_for(body.timeout_s)
    if body.stream:
        stream = service.open_stream(run, timeout_s=timeout_s)
        return sse_response(_relay(stream, service, time.perf_counter()))
    answer, context = await service.call(run, timeout_s=timeout_s, request=request)
    response = ask_response(answer, context.queue_seconds)
    service.metrics.observe_generation(ROUTE, answer.usage, response.timings.time_to_first_token_ms / 1000.0)
    return response


async def _relay(stream: EventStream, service: Service, received: float) -> AsyncIterator[str]:
    """SSE frames of an ask: sources, tokens, done (or error), [DONE]."""
    first_token_at: float | None = None
    try:
        async for kind, value in stream.events():
            if kind == "sources":
                yield sse_event({"type": "sources", "sources": [
                    source_out(source, rank).model_dump() for rank, source in enumerate(value, start=1)]})
            elif kind == "token":
                if first_token_at is None:
                    first_token_at = time.perf_counter()
                yield sse_event({"type": "token", "text": value})
        assert stream.task is not None
        answer: Answer = stream.task.future.result()
        response = ask_response(answer, stream.task.context.queue_seconds)
        ttft = (first_token_at or time.perf_counter()) - received
        response.timings.time_to_first_token_ms = round(ttft * 1000.0, 3)
        service.metrics.observe_generation(ROUTE, answer.usage, ttft)
        payload = response.model_dump(exclude={"sources"})
        yield sse_event({"type": "done", **payload})
    except ServiceError as error:
        log_refusal(error.status, error.message)
        yield sse_event({"type": "error", **error.body()})
    except Exception as error:
        log_unexpected(error, "failed in its stream")
        yield sse_event({"type": "error", **internal_error_body(error)})
    yield DONE

