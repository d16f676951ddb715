"""OpenAI-compatible `POST /v1/completions` and `GET /v1/models`.

The prompt is split at the separator (default `<<PIC_SEP>>`): every part but the last is a segment whose cached
entry is reused wherever it lands (encoded and stored on first sight), the last part is the query. An existing
OpenAI client thus gets position-independent reuse without the retriever. A prompt without a separator is one
query segment, recomputed in full.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.server.backend import CompletionResult, check_segment_count
from hypic_rag.server.errors import BadRequestError, PayloadTooLargeError, ServiceError, internal_error_body
from hypic_rag.server.openai_schemas import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionUsage,
    HypicDetails,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    chunk_payload,
    stop_strings,
)
from hypic_rag.server.routes_ask import ERROR_RESPONSES
from hypic_rag.server.segments import split_segments
from hypic_rag.server.service import EventStream, Service, ServiceDep
from hypic_rag.server.sse import DONE, sse_event, sse_response
from hypic_rag.server.validation import checked_at_most, checked_mode
from hypic_rag.server.worker import TaskContext

logger = logging.getLogger(__name__)

ROUTE = "/v1/completions"
router = APIRouter(tags=["openai"])


def split_prompt(prompt: str | list[str], separator: str, max_chars: int) -> list[str]:
    """The prompt's segments (the last one is the query); 400 for what this endpoint does not support."""
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise BadRequestError(
                f"prompt: batched prompts are not supported ({len(prompt)} given); send one prompt per request",
                param="prompt",
            )
        prompt = prompt[0]
    if len(prompt) > max_chars:
        raise PayloadTooLargeError(
            f"prompt has {len(prompt)} characters; this server accepts at most {max_chars}", param="prompt"
        )
    segments = split_segments(prompt, separator)
    if not segments[-1].strip():
        raise BadRequestError("prompt: the last segment (the query) is empty", param="prompt")
    return segments


def _check_supported(body: CompletionRequest) -> None:
    unsupported = {
        "n": body.n != 1,
        "best_of": body.best_of not in (None, 1),
        "echo": body.echo,
        "logprobs": body.logprobs is not None,
        "suffix": bool(body.suffix),
    }
    for name, used in unsupported.items():
        if used:
            raise BadRequestError(f"{name}: not supported by hypic-rag (leave it at its default)", param=name)


def completion_response(
    result: CompletionResult, completion_id: str, created: int, model: str, mode: str, segments: int, queue_s: float
) -> CompletionResponse:
    usage = result.usage
    return CompletionResponse(
        id=completion_id,
        created=created,
        model=model,
        choices=[CompletionChoice(text=result.text, finish_reason=result.finish_reason)],
        usage=CompletionUsage(
            prompt_tokens=usage["prompt_tokens"],
            completion_tokens=usage["completion_tokens"],
            total_tokens=usage["prompt_tokens"] + usage["completion_tokens"],
            prompt_tokens_details=PromptTokensDetails(cached_tokens=usage["cached_tokens"]),
        ),
        hypic=HypicDetails(
            mode=mode,
            segments=segments,
            encoded_tokens=usage["encoded_tokens"],
            recomputed_tokens=usage["recomputed_tokens"],
            cache_hits=usage["cache_hits"],
            cache_misses=usage["cache_misses"],
            timings={
                "queue_ms": round(queue_s * 1000.0, 3),
                **{f"{name}_ms": round(seconds * 1000.0, 3) for name, seconds in result.timings.items()},
            },
        ),
    )


@router.post("/v1/completions", response_model=CompletionResponse, response_model_exclude_none=True,
             responses=ERROR_RESPONSES, summary="OpenAI-compatible completion over separated segments")
async def completions(body: CompletionRequest, request: Request, service: ServiceDep) -> Any:
    """OpenAI's completions API. hypic-rag extensions: `mode` and `separator`; the response adds `hypic`."""
    config = service.config
    _check_supported(body)
    mode = checked_mode(body.mode)
    checked_at_most("max_tokens", body.max_tokens, config.max_new_tokens)
    segments = split_prompt(body.prompt, body.separator or config.separator, config.max_prompt_chars)
    check_segment_count(segments, config.max_segments)
    params = SamplingParams(
        max_new_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop_strings=stop_strings(body.stop),
    )

    def run(backend: Any, context: TaskContext) -> CompletionResult:
        return backend.complete(segments, mode=mode, params=params, context=context)

    completion_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = service.backend.model_name
    timeout_s = service.timeout_for(None)
    if body.stream:
        stream = service.open_stream(run, timeout_s=timeout_s)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        relay = _relay(stream, service, completion_id, created, model, mode, len(segments), include_usage)
        return sse_response(relay)
    result, context = await service.call(run, timeout_s=timeout_s, request=request)
    response = completion_response(result, completion_id, created, model, mode, len(segments), context.queue_seconds)
    ttft = context.queue_seconds + result.timings.get("time_to_first_token", 0.0)
    service.metrics.observe_generation(ROUTE, result.usage, ttft)
    return response


async def _relay(
    stream: EventStream, service: Service, completion_id: str, created: int, model: str, mode: str, segments: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    """OpenAI's stream framing: one chunk per text delta, a last chunk with finish_reason, then [DONE]."""
    received = time.perf_counter()
    first_token_at: float | None = None
    try:
        async for _, delta in stream.events():
            if first_token_at is None:
                first_token_at = time.perf_counter()
            yield sse_event(chunk_payload(completion_id, created, model, delta, None))
        assert stream.task is not None
        result: CompletionResult = stream.task.future.result()
        yield sse_event(chunk_payload(completion_id, created, model, "", result.finish_reason))
        service.metrics.observe_generation(ROUTE, result.usage, (first_token_at or time.perf_counter()) - received)
        if include_usage:
            full = completion_response(
                result, completion_id, created, model, mode, segments, stream.task.context.queue_seconds
            )
            final = chunk_payload(completion_id, created, model, "", None)
            final["choices"] = []
            final["usage"] = full.usage.model_dump() if full.usage else None
            final["hypic"] = full.hypic.model_dump() if full.hypic else None
            yield sse_event(final)
    except ServiceError as error:
        yield sse_event(error.body())
    except Exception as error:
        logger.exception("streamed completion failed")
        yield sse_event(internal_error_body(error))
    yield DONE


@router.get("/v1/models", response_model=ModelList, summary="The served model (OpenAI-compatible)")
async def models(service: ServiceDep) -> ModelList:
    return ModelList(data=[ModelCard(id=service.backend.model_name, created=int(service.started_at))])
