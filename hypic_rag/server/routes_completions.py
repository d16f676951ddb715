"""OpenAI-compatible `POST /v1/completions` and `GET /v1/models`.

The prompt is split at the separator (default `<<PIC_SEP>>`): every part but the last is a segment whose cached
entry is reused wherever it lands (encoded and stored on first sight), the last part is the query. An existing
OpenAI client thus gets position-independent reuse without the retriever. The query part (the whole prompt when
it has no separator) is cut around the indexed chunks and previously seen segments it contains (`hypic_rag.prompting.matching`),
so text pasted without separators reuses its cached entries too; what no match covers is recomputed as before.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

from fastapi import APIRouter, Request

from hypic_rag.prompting.matching import separated_pieces
from hypic_rag.runtime.request import Request as HypicRequest
from hypic_rag.prompting.segments import split_segments
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.server.backend import CompletionResult, PromptBuilder, ServiceBackend, check_segment_count
from hypic_rag.server.deferred import Deferred
from hypic_rag.server.errors import BadRequestError, PayloadTooLargeError
from hypic_rag.server.openai_common import (
    INDEX_MODEL_SUFFIX,
    OpenAIFraming,
    check_at_most,
    check_model,
    hypic_details,
    sampling_params,
    total_usage,
    usage_model,
)
from hypic_rag.server.openai_schemas import (
    MAX_CHOICES,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    chunk_payload,
    stop_strings,
)
from hypic_rag.server.routes_ask import ERROR_RESPONSES
from hypic_rag.server.service import ServiceDep
from hypic_rag.server.sse import Frames, stream_response
from hypic_rag.server.validation import checked_mode
from hypic_rag.server.task_context import TaskContext


ROUTE = "/v1/completions"
router = APIRouter(tags=["openai"])


def split_prompt(prompt: str, separator: str, max_chars: int) -> list[str]:
    """The prompt's segments (the last one is the query); 413 over the size limit, 400 for an empty query."""
    if len(prompt) > max_chars:
        raise PayloadTooLargeError(
            f"prompt has {len(prompt)} characters; this server accepts at most {max_chars}", param="prompt"
        )
    segments = split_segments(prompt, separator)
    if not segments[-1].strip():
        raise BadRequestError("prompt: the last segment (the query) is empty", param="prompt")
    return segments


def prompt_list(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """The request's prompts: a string or a token-id list is one prompt; a list of either is several."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequestError("prompt: an empty list holds no prompt", param="prompt")
    if all(isinstance(item, int) for item in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def _check_supported(body: CompletionRequest) -> None:
    unsupported = {
        "best_of": body.best_of not in (None, 1, body.n),
        "suffix": bool(body.suffix),
        "echo with logprobs (prompt log-probabilities)": body.echo and body.logprobs is not None,
        "logprobs with stream": body.stream and body.logprobs is not None,
        "echo with stream": body.stream and body.echo,
    }
    for name, used in unsupported.items():
        if used:
            raise BadRequestError(f"{name}: not supported by hypic-rag", param=name.split()[0])


def completion_logprobs(items: list[dict[str, Any]], offset: int) -> CompletionLogprobs:
    """OpenAI's completions `logprobs` object; text offsets count from `offset` (the echoed prompt's length)."""
    offsets = []
    for item in items:
        offsets.append(offset)
        offset += len(item["token"])
    return CompletionLogprobs(
        tokens=[item["token"] for item in items],
        token_logprobs=[item["logprob"] for item in items],
        top_logprobs=[{**{top["token"]: top["logprob"] for top in item["top"]}, item["token"]: item["logprob"]}
                      for item in items],
        text_offset=offsets,
    )


def completion_response(
    results: list[CompletionResult], echoes: list[str], n: int, completion_id: str, created: int, model: str,
    mode: str, queue_s: float,
) -> CompletionResponse:
    usage = total_usage(results, n)
    choices = []
    for index, result in enumerate(results):
        echo = echoes[index // n] if echoes else ""
        logprobs = None if result.logprobs is None else completion_logprobs(result.logprobs, len(echo))
        choices.append(CompletionChoice(text=echo + result.text, index=index, logprobs=logprobs,
                                        finish_reason=result.finish_reason))
    return CompletionResponse(
        id=completion_id, created=created, model=model, choices=choices, usage=usage_model(usage),
        hypic=hypic_details(usage, results[0], mode, queue_s),
    )


@router.post("/v1/completions", response_model=CompletionResponse, response_model_exclude_none=True,
             responses=ERROR_RESPONSES, summary="OpenAI-compatible completion over separated segments")
async def completions(body: CompletionRequest, request: Request, service: ServiceDep) -> Any:
    """OpenAI's completions API (vLLM's parameters). hypic-rag extensions: `mode`, `separator` and
    `match_segments`; the response adds `hypic` and `usage.encoded_tokens`."""
    received = time.perf_counter()
    config = service.config
    model = service.backend.model_name
    check_model(body.model, model, over_index=False)
    _check_supported(body)
    mode = checked_mode(body.mode)
    check_at_most("max_tokens", body.max_tokens, config.max_new_tokens)
    prompts = prompt_list(body.prompt)
    check_at_most("n * prompts", body.n * len(prompts), MAX_CHOICES * 4)
    separator = body.separator or config.separator
    match = config.match_segments if body.match_segments is None else body.match_segments
    builders: list[PromptBuilder] = []
    for prompt in prompts:
        if isinstance(prompt, str):
            segments = split_prompt(prompt, separator, config.max_prompt_chars)
            check_segment_count(segments, config.max_segments)
            pieces = separated_pieces(segments)
            builders.append(lambda session, pieces=pieces: session.segmented_prompt(pieces, match=match))
        else:
            builders.append(lambda session, ids=prompt: HypicRequest([], [], list(ids)))
    params = sampling_params(body, max_tokens=body.max_tokens, stops=stop_strings(body.stop), logprobs=body.logprobs)

    work = CompletionWork(builders, prompts, body.n, mode, params, body.echo)
    completion_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    channel = service.submit(work, timeout_s=service.timeout_for(None))
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        framing = CompletionFraming(service, channel.context, completion_id, created, model, mode, body.n,
                                    include_usage)
        return stream_response(channel, framing, received)
    results, echoes = await channel.result(request)
    context = channel.context
    response = completion_response(results, echoes, body.n, completion_id, created, model, mode,
                                   context.queue_seconds)
    ttft = context.queue_seconds + results[0].timings.get("time_to_first_token", 0.0)
    service.metrics.observe_generation(ROUTE, total_usage(results, body.n), ttft)
    return response


@dataclass(frozen=True, slots=True)
class CompletionWork:
    """What `/v1/completions` runs on the model worker: `n` choices of each prompt, and the prompts' text when
    they are echoed."""

    builders: list[PromptBuilder]
    prompts: list[str | list[int]]
    n: int
    mode: str
    params: SamplingParams
    echo: bool

    def __call__(self, backend: ServiceBackend,
                 context: TaskContext) -> Deferred[tuple[list[CompletionResult], list[str]]]:
        results = backend.complete_choices(self.builders, n=self.n, mode=self.mode, params=self.params,
                                           context=context)
        echoes = [p if isinstance(p, str) else backend.decode(p) for p in self.prompts] if self.echo else []
        return results.then(lambda choices: (choices, echoes))


@dataclass(frozen=True, slots=True)
class CompletionFraming(OpenAIFraming):
    """OpenAI's completion stream (`text_completion` chunks, `OpenAIFraming`'s order)."""

    ROUTE: ClassVar[str] = ROUTE

    def chunk(self, index: int, text: str | None, finish_reason: str | None) -> dict[str, Any]:
        return chunk_payload(self.completion_id, self.created, self.model, text or "", finish_reason, index)

    def closing(self, outcome: tuple[list[CompletionResult], list[str]], first_token_seconds: float) -> Frames:
        return OpenAIFraming.closing(self, outcome[0], first_token_seconds)


@router.get("/v1/models", response_model=ModelList, summary="The served model (OpenAI-compatible)")
async def models(service: ServiceDep) -> ModelList:
    """The served model, and its id plus `+index`: chats with it are answered from the served index."""
    served, created = service.backend.model_name, int(service.started_at)
    return ModelList(data=[ModelCard(id=served, created=created),
                           ModelCard(id=served + INDEX_MODEL_SUFFIX, created=created)])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERROR_RESPONSES,
            summary="One model (OpenAI-compatible); 404 unless it is the served one")
async def model_card(model_id: str, service: ServiceDep) -> ModelCard:
    check_model(model_id, service.backend.model_name)
    return ModelCard(id=model_id, created=int(service.started_at))
