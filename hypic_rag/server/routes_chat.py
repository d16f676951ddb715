"""OpenAI-compatible `POST /v1/chat/completions`, streaming and not.

Messages are rendered with the model's chat template when its tokenizer has one, else with the index's prompt
format (`hypic_rag.prompting.chat`); documents (content parts, or text cut at the separator) are cached segments, so a
repeated request with the same documents reuses their entries (`usage.prompt_tokens_details.cached_tokens`). The
rest of the rendered prompt is cut around the indexed chunks and seen segments it contains (`hypic_rag.prompting.matching`), so
documents pasted into a message without separators are reused too.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from hypic_rag.prompting.chat import ChatMessage, chat_prompt
from hypic_rag.server.backend import CompletionResult
from hypic_rag.server.deferred import Deferred
from hypic_rag.server.chat_schemas import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    chat_chunk,
)
from hypic_rag.server.errors import BadRequestError, PayloadTooLargeError, ServiceError, internal_error_body
from hypic_rag.server.openai_common import (
    check_at_most,
    check_model,
    hypic_details,
    sampling_params,
    total_usage,
    usage_model,
    usage_payload,
)
from hypic_rag.server.openai_schemas import stop_strings
from hypic_rag.server.routes_ask import ERROR_RESPONSES
from hypic_rag.server.service import EventStream, Service, ServiceDep
from hypic_rag.server.request_log import log_refusal, log_unexpected
from hypic_rag.server.sse import DONE, sse_event, sse_response
from hypic_rag.server.validation import checked_mode
from hypic_rag.server.worker import TaskContext


ROUTE = "/v1/chat/completions"
router = APIRouter(tags=["openai"])


def messages_of(body: ChatCompletionRequest, separator: str, max_chars: int) -> list[ChatMessage]:
    """The request's messages as `ChatMessage`s (413 when their text exceeds the prompt limit)."""
    messages = []
    for message in body.messages:
        content = message.content
        parts = [part.text for part in content] if isinstance(content, list) else content
        messages.append(ChatMessage.of(message.role, parts, separator))
    size = sum(len(part) for message in messages for part in message.parts)
    if size > max_chars:
        raise PayloadTooLargeError(f"messages have {size} characters; this server accepts at most {max_chars}",
                                   param="messages")
    return messages


def chat_logprobs(items: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """OpenAI's chat `logprobs` object."""
    if items is None:
        return None
    return {"content": [
        {"token": item["token"], "logprob": item["logprob"], "bytes": item["bytes"],
         "top_logprobs": [{"token": top["token"], "logprob": top["logprob"], "bytes": top["bytes"]}
                          for top in item["top"]]}
        for item in items
    ]}


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, response_model_exclude_none=True,
             responses=ERROR_RESPONSES, summary="OpenAI-compatible chat completion; documents cached as segments")
async def chat_completions(body: ChatCompletionRequest, request: Request, service: ServiceDep) -> Any:
    """OpenAI's chat completions API (vLLM's parameters). hypic-rag extensions: `mode`, `separator`,
    `match_segments`; the response adds `hypic` and `usage.encoded_tokens`."""
    config = service.config
    model = service.backend.model_name
    check_model(body.model, model)
    mode = checked_mode(body.mode)
    if body.stream and body.logprobs:
        raise BadRequestError("logprobs with stream: not supported by hypic-rag", param="logprobs")
    if body.top_logprobs is not None and not body.logprobs:
        raise BadRequestError("top_logprobs: needs logprobs set to true", param="top_logprobs")
    max_tokens = body.max_completion_tokens or body.max_tokens or config.max_new_tokens
    check_at_most("max_completion_tokens", max_tokens, config.max_new_tokens)
    messages = messages_of(body, body.separator or config.separator, config.max_prompt_chars)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens=max_tokens, stops=stop_strings(body.stop), logprobs=logprobs)
    match = config.match_segments if body.match_segments is None else body.match_segments

    def run(backend: Any, context: TaskContext) -> Deferred[list[CompletionResult]]:
        session = backend.pipeline.session
        matcher = session.matcher if match and session.matcher.settings.enabled else None
        try:
            prompt = chat_prompt(session.tokenizer, messages, session.prompt_format, matcher)
        except ValueError as error:  # an empty question, a lone surrogate: the client's input, not a bug
            raise BadRequestError(f"messages: {error}", param="messages") from None
        choice_params = params
        if prompt.stop_strings:  # the product's format ends the answer at its stop string, as /v1/ask does
            choice_params = dataclasses.replace(params, stop_strings=params.stop_strings + prompt.stop_strings)
        return backend.complete_choices([lambda _: prompt.prompt], n=body.n, mode=mode, params=choice_params,
                                         context=context, param="messages")

    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    timeout_s = service.timeout_for(None)
    if body.stream:
        stream = service.open_stream(run, timeout_s=timeout_s)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(_relay(stream, service, completion_id, created, model, mode, body.n, include_usage))
    results, context = await service.call(run, timeout_s=timeout_s, request=request)
    usage = total_usage(results, body.n)
    ttft = context.queue_seconds + results[0].timings.get("time_to_first_token", 0.0)
    service.metrics.observe_generation(ROUTE, usage, ttft)
    return ChatCompletionResponse(
        id=completion_id, created=created, model=model,
        choices=[ChatChoice(index=index, message=ChatMessageOut(content=result.text),
                            logprobs=chat_logprobs(result.logprobs), finish_reason=result.finish_reason)
                 for index, result in enumerate(results)],
        usage=usage_model(usage),
        hypic=hypic_details(usage, results[0], mode, context.queue_seconds),
    )


async def _relay(
    stream: EventStream, service: Service, completion_id: str, created: int, model: str, mode: str, n: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    """`chat.completion.chunk` framing: a role chunk per choice, one chunk per text delta, a chunk with each
    choice's finish_reason, the usage chunk when asked, then [DONE]."""
    received = time.perf_counter()
    first_token_at: float | None = None
    for index in range(n):
        yield sse_event(chat_chunk(completion_id, created, model, index, {"role": "assistant", "content": ""}, None))
    try:
        async for _, index, delta in stream.events():
            if first_token_at is None:
                first_token_at = time.perf_counter()
            yield sse_event(chat_chunk(completion_id, created, model, index, {"content": delta}, None))
        assert stream.task is not None
        results: list[CompletionResult] = stream.task.future.result()
        for index, result in enumerate(results):
            yield sse_event(chat_chunk(completion_id, created, model, index, {}, result.finish_reason))
        usage = total_usage(results, n)
        service.metrics.observe_generation(ROUTE, usage, (first_token_at or time.perf_counter()) - received)
        if include_usage:
            final = chat_chunk(completion_id, created, model, 0, {}, None)
            final["choices"] = []
            final.update(usage_payload(usage_model(usage), hypic_details(
                usage, results[0], mode, stream.task.context.queue_seconds)))
            yield sse_event(final)
    except ServiceError as error:
        log_refusal(error.status, error.message)
        yield sse_event(error.body())
    except Exception as error:
        log_unexpected(error, "failed in its stream")
        yield sse_event(internal_error_body(error))
    yield DONE
