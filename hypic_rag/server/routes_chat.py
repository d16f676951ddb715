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
from dataclasses import dataclass
from typing import Any, ClassVar

from fastapi import APIRouter, Request

from hypic_rag.pipeline.answering import Answer, Question
from hypic_rag.prompting.chat import ChatMessage, chat_prompt
from hypic_rag.prompting.matching import NO_MATCHING
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.server.backend import CompletionResult, ServiceBackend
from hypic_rag.server.events import Event, SourcesEvent
from hypic_rag.server.deferred import Deferred
from hypic_rag.server.chat_schemas import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    chat_chunk,
)
from hypic_rag.server.errors import BadRequestError, PayloadTooLargeError
from hypic_rag.server.openai_common import (
    OpenAIFraming,
    check_at_most,
    check_model,
    hypic_details,
    sampling_params,
    total_usage,
    usage_model,
)
from hypic_rag.server.openai_schemas import stop_strings
from hypic_rag.server.routes_ask import ERROR_RESPONSES, INDEX_TOP_K, source_out, sources_out
from hypic_rag.server.service import Service, ServiceDep
from hypic_rag.server.sse import Frames, stream_response
from hypic_rag.server.validation import checked_mode, checked_question
from hypic_rag.server.task_context import TaskContext


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
    `match_segments`; the response adds `hypic` and `usage.encoded_tokens`. With `model` set to the served
    model's id plus `+index` (listed by /v1/models), the last user message is answered from the served index as
    `/v1/ask` answers it, and the response adds `sources`."""
    received = time.perf_counter()
    config = service.config
    served = service.backend.model_name
    over_index = check_model(body.model, served)
    model = body.model or served
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
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    if over_index:
        return await _chat_over_index(body, request, service, messages, params, mode, model, completion_id,
                                      created, include_usage, received)
    match = config.match_segments if body.match_segments is None else body.match_segments
    channel = service.submit(ChatWork(messages, body.n, mode, params, match), timeout_s=service.timeout_for(None))
    if body.stream:
        framing = ChatFraming(service, channel.context, completion_id, created, model, mode, body.n, include_usage)
        return stream_response(channel, framing, received)
    results = await channel.result(request)
    context = channel.context
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


async def _chat_over_index(
    body: ChatCompletionRequest, request: Request, service: Service, messages: list[ChatMessage],
    params: SamplingParams, mode: str, model: str, completion_id: str, created: int, include_usage: bool,
    received: float,
) -> Any:
    """The last user message answered from the served index, through the same retrieval stage and scheduler as
    `/v1/ask` (so the same cache reuse and the same answer); earlier messages do not enter the prompt."""
    if body.n != 1:
        raise BadRequestError(f"n: a chat over the index ({model}) answers one choice", param="n")
    if body.logprobs:
        raise BadRequestError(f"logprobs: not supported for a chat over the index ({model})", param="logprobs")
    asked = [message for message in messages if message.role == "user"]
    if not asked:
        raise BadRequestError("messages: a chat over the index needs a user message (the question)",
                              param="messages")
    question = checked_question(" ".join(part for part in asked[-1].parts if part.strip()), service.config)
    backend = service.backend
    params = dataclasses.replace(params, stop_strings=params.stop_strings
                                 + (backend.pipeline.prompt_format.answer_stop,))
    channel = service.ask(Question(question, INDEX_TOP_K, mode), params, timeout_s=service.timeout_for(None))
    if body.stream:
        framing = IndexChatFraming(ChatFraming(service, channel.context, completion_id, created, model, mode, 1,
                                               include_usage))
        return stream_response(channel, framing, received)
    answer = await channel.result(request)
    result = answer_result(answer)
    usage = total_usage([result], 1)
    service.metrics.observe_generation(ROUTE, usage, channel.context.queue_seconds + answer.timings.get(
        "time_to_first_token", 0.0))
    return ChatCompletionResponse(
        id=completion_id, created=created, model=model,
        choices=[ChatChoice(index=0, message=ChatMessageOut(content=answer.text), finish_reason=answer.finish_reason)],
        usage=usage_model(usage),
        hypic=hypic_details(usage, result, mode, channel.context.queue_seconds),
        sources=[source_out(source, rank) for rank, source in enumerate(answer.sources, start=1)],
    )


def answer_result(answer: Answer) -> CompletionResult:
    """An `Answer` as a completion's result (its usage with the assembly counts the OpenAI routes report: the
    retrieved chunks and the question are the segments, none matched in text)."""
    usage = {**answer.usage, **NO_MATCHING, "segments": len(answer.sources) + 1}
    return CompletionResult(answer.text, answer.finish_reason, usage, dict(answer.timings))


@dataclass(frozen=True, slots=True)
class ChatWork:
    """What a chat runs on the model worker: its messages rendered (the model's chat template, else the index's
    prompt format; documents as cached segments) and `n` choices generated."""

    messages: list[ChatMessage]
    n: int
    mode: str
    params: SamplingParams
    match: bool

    def __call__(self, backend: ServiceBackend, context: TaskContext) -> Deferred[list[CompletionResult]]:
        session = backend.pipeline.session
        matcher = session.matcher if self.match and session.matcher.settings.enabled else None
        try:
            prompt = chat_prompt(session.tokenizer, self.messages, session.prompt_format, matcher)
        except ValueError as error:  # an empty question, a lone surrogate: the client's input, not a bug
            raise BadRequestError(f"messages: {error}", param="messages") from None
        params = self.params
        if prompt.stop_strings:  # the product's format ends the answer at its stop string, as /v1/ask does
            params = dataclasses.replace(params, stop_strings=params.stop_strings + prompt.stop_strings)
        return backend.complete_choices([lambda _: prompt.prompt], n=self.n, mode=self.mode, params=params,
                                        context=context, param="messages")


@dataclass(frozen=True, slots=True)
class ChatFraming(OpenAIFraming):
    """`chat.completion.chunk`s: a role chunk per choice first, then `OpenAIFraming`'s."""

    ROUTE: ClassVar[str] = ROUTE

    def chunk(self, index: int, text: str | None, finish_reason: str | None) -> dict[str, Any]:
        delta = {} if text is None else {"content": text}
        return chat_chunk(self.completion_id, self.created, self.model, index, delta, finish_reason)

    def opening(self) -> Frames:
        return [chat_chunk(self.completion_id, self.created, self.model, index, {"role": "assistant", "content": ""},
                           None) for index in range(self.n)]


@dataclass(frozen=True, slots=True)
class IndexChatFraming:
    """A chat over the index: `ChatFraming`'s chunks, the retrieved chunks as `sources` on a chunk of their own
    (empty `choices`) before the first text."""

    chat: ChatFraming

    def opening(self) -> Frames:
        return self.chat.opening()

    def event(self, event: Event) -> Frames:
        if isinstance(event, SourcesEvent):
            frame = self.chat.chunk(0, None, None)
            frame["choices"] = []
            frame["sources"] = sources_out(event.sources)
            return [frame]
        return self.chat.event(event)

    def closing(self, answer: Answer, first_token_seconds: float) -> Frames:
        return self.chat.closing([answer_result(answer)], first_token_seconds)

    def error(self, body: dict[str, Any]) -> dict[str, Any]:
        return body
