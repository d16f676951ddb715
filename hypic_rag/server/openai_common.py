"""What `/v1/completions` and `/v1/chat/completions` share: the model check, sampling parameters, usage."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.server.backend import CompletionResult
from hypic_rag.server.events import Event, TextEvent
from hypic_rag.server.errors import BadRequestError, ModelNotFoundError
from hypic_rag.server.openai_schemas import CompletionUsage, HypicDetails, PromptTokensDetails, SamplingFields
from hypic_rag.server.service import Service
from hypic_rag.server.sse import Frames
from hypic_rag.server.task_context import TaskContext
from hypic_rag.pipeline.vocabulary import MATCHING_FIELDS, USAGE_FIELDS

INDEX_MODEL_SUFFIX = "+index"
"""Appended to the served model's id, the model id of a chat answered from the served index (`/v1/chat/completions`
retrieves for the last user message, as `/v1/ask` does)."""


def check_model(model: str | None, served: str, *, over_index: bool = True) -> bool:
    """404 (OpenAI's body: `invalid_request_error`, code `model_not_found`, `param: model`) unless `model` is
    absent, the served model's id, or (`over_index`) that id plus `INDEX_MODEL_SUFFIX`; True for the latter."""
    if model is None or model == served:
        return False
    if over_index and model == served + INDEX_MODEL_SUFFIX:
        return True
    also = f" (or `{served}{INDEX_MODEL_SUFFIX}`, answering from the served index)" if over_index else ""
    raise ModelNotFoundError(f"The model `{model}` does not exist; this server serves `{served}`{also}",
                             param="model")


def check_at_most(name: str, value: int, limit: int) -> int:
    """400 when `value` exceeds this server's `limit` (OpenAI's routes answer 400 for every invalid field)."""
    if value > limit:
        raise BadRequestError(f"{name}: must be at most {limit} on this server, got {value}", param=name)
    return value


def sampling_params(body: SamplingFields, *, max_tokens: int, stops: tuple[str, ...],
                    logprobs: int | None) -> SamplingParams:
    """The `SamplingParams` of an OpenAI request's fields."""
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=max(body.top_k or 0, 0),
        seed=body.seed,
        stop_strings=stops,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias={int(token): bias for token, bias in (body.logit_bias or {}).items()},
        logprobs=logprobs,
    )


def total_usage(results: Sequence[CompletionResult], n: int) -> dict[str, int]:
    """Usage of `n` choices per prompt: each prompt's prompt-side counts once (its first choice's), completion
    tokens of every choice."""
    first = results[::n]
    keys = [key for key in USAGE_FIELDS + MATCHING_FIELDS if key != "completion_tokens"]
    usage = {key: sum(result.usage[key] for result in first) for key in keys}
    usage["completion_tokens"] = sum(result.usage["completion_tokens"] for result in results)
    return usage


def usage_model(usage: dict[str, int]) -> CompletionUsage:
    """OpenAI's usage object (`prompt_tokens_details.cached_tokens` included) with hypic-rag's counters."""
    return CompletionUsage(
        total_tokens=usage["prompt_tokens"] + usage["completion_tokens"],
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage["cached_tokens"]),
        **{name: usage[name] for name in USAGE_FIELDS + MATCHING_FIELDS},
    )


def hypic_details(usage: dict[str, int], result: CompletionResult, mode: str, queue_s: float) -> HypicDetails:
    """The `hypic` extension object: the assembly mode and the first choice's timings (ms)."""
    return HypicDetails(
        mode=mode,
        timings={
            "queue_ms": round(queue_s * 1000.0, 3),
            **{f"{name}_ms": round(seconds * 1000.0, 3) for name, seconds in result.timings.items()},
        },
    )


def usage_payload(usage: CompletionUsage, hypic: HypicDetails) -> dict[str, Any]:
    """The usage chunk's extra fields of a stream (`stream_options.include_usage`)."""
    return {"usage": usage.model_dump(exclude_none=True), "hypic": hypic.model_dump()}


@dataclass(frozen=True, slots=True)
class OpenAIFraming:
    """What OpenAI's completion and chat streams share (`sse.StreamFraming`): a chunk per text delta (its choice's
    index), a chunk with each choice's finish_reason, then the usage chunk when asked (`choices: []`, with our
    `hypic` details). A stream kind gives its `ROUTE` and its `chunk`."""

    ROUTE: ClassVar[str] = ""
    service: Service
    context: TaskContext
    completion_id: str
    created: int
    model: str
    mode: str
    n: int
    include_usage: bool

    def chunk(self, index: int, text: str | None, finish_reason: str | None) -> dict[str, Any]:
        """The stream's chunk of choice `index`: `text` added (None: no text field), or its finish_reason."""
        raise NotImplementedError

    def opening(self) -> Frames:
        return []

    def event(self, event: Event) -> Frames:
        return [self.chunk(event.choice, event.text, None)] if isinstance(event, TextEvent) else []

    def closing(self, results: list[CompletionResult], first_token_seconds: float) -> Frames:
        frames = [self.chunk(index, None, result.finish_reason) for index, result in enumerate(results)]
        usage = total_usage(results, self.n)
        self.service.metrics.observe_generation(self.ROUTE, usage, first_token_seconds)
        if self.include_usage:
            final = self.chunk(0, None, None)
            final["choices"] = []
            final.update(usage_payload(usage_model(usage), hypic_details(usage, results[0], self.mode,
                                                                         self.context.queue_seconds)))
            frames.append(final)
        return frames

    def error(self, body: dict[str, Any]) -> dict[str, Any]:
        return body
