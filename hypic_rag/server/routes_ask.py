"""`POST /v1/ask`: retrieve, compose the chunks' cached segments, generate; JSON or server-sent events."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request

from hypic_rag.pipeline.answering import Answer, Question, Source
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.server.events import Event, SourcesEvent
from hypic_rag.server.schemas import AskRequest, AskResponse, AskTimings, PromptPartOut, SourceOut, Usage
from hypic_rag.server.service import Service, ServiceDep
from hypic_rag.server.sse import Frames, stream_response
from hypic_rag.server.validation import checked_at_most, checked_mode, checked_question, checked_recompute_policy
from hypic_rag.server.task_context import TaskContext
from hypic_rag.pipeline.vocabulary import source_record


ROUTE = "/v1/ask"
INDEX_TOP_K = int(AskRequest.model_fields["top_k"].default)
"""Chunks retrieved for a question that does not say (`/v1/ask`'s default; a chat over the index uses it)."""
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


def sources_out(sources: list[Source]) -> list[dict[str, Any]]:
    """The sources as JSON, ranked from 1 (best first)."""
    return [source_out(source, rank).model_dump() for rank, source in enumerate(sources, start=1)]


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
        prompt_parts=[PromptPartOut(**part) for part in answer.prompt_parts],
    )


@router.post("/v1/ask", response_model=AskResponse, responses=ERROR_RESPONSES, summary="Answer a question")
async def ask(body: AskRequest, request: Request, service: ServiceDep) -> Any:
    """Retrieve `top_k` chunks, assemble their cached segments under `mode`, generate the answer.

    With `stream: true` the answer comes as server-sent events: one `sources` event, `token` events, a `done`
    event (usage and timings), then `data: [DONE]`; an error after the stream started is an `error` event.
    """
    received = time.perf_counter()
    config = service.config
    question = checked_question(body.question, config)
    mode = checked_mode(body.mode)
    backend = service.backend
    policy = checked_recompute_policy(body.recompute_policy, backend.entry_seams, backend.counts.longest_chunk)
    checked_at_most("top_k", body.top_k, config.max_top_k)
    checked_at_most("max_new_tokens", body.max_new_tokens, config.max_new_tokens)
    params = SamplingParams(max_new_tokens=body.max_new_tokens, temperature=body.temperature, top_p=body.top_p,
                            seed=body.seed, stop_strings=(backend.pipeline.prompt_format.answer_stop,))
    channel = service.ask(Question(question, body.top_k, mode, policy), params,
                          timeout_s=service.timeout_for(body.timeout_s))
    if body.stream:
        return stream_response(channel, AskFraming(service, channel.context), received)
    answer = await channel.result(request)
    response = ask_response(answer, channel.context.queue_seconds)
    service.metrics.observe_generation(ROUTE, answer.usage, response.timings.time_to_first_token_ms / 1000.0)
    return response


@dataclass(frozen=True, slots=True)
class AskFraming:
    """`/v1/ask`'s events: `sources`, `token`s, `done` (the response without its sources) or `error`."""

    service: Service
    context: TaskContext

    def opening(self) -> Frames:
        return []

    def event(self, event: Event) -> Frames:
        if isinstance(event, SourcesEvent):
            return [{"type": "sources", "sources": sources_out(event.sources)}]
        return [{"type": "token", "text": event.text}]

    def closing(self, answer: Answer, first_token_seconds: float) -> Frames:
        response = ask_response(answer, self.context.queue_seconds)
        response.timings.time_to_first_token_ms = round(first_token_seconds * 1000.0, 3)
        self.service.metrics.observe_generation(ROUTE, answer.usage, first_token_seconds)
        return [{"type": "done", **response.model_dump(exclude={"sources"})}]

    def error(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"type": "error", **body}
