"""What `/v1/completions` and `/v1/chat/completions` share: the model check, sampling parameters, usage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.server.backend import CompletionResult
from hypic_rag.server.errors import BadRequestError, ModelNotFoundError
from hypic_rag.server.openai_schemas import CompletionUsage, HypicDetails, PromptTokensDetails, SamplingFields
from hypic_rag.vocabulary import MATCHING_FIELDS, USAGE_FIELDS


def check_model(model: str | None, served: str) -> None:
    """404 (OpenAI's body: `invalid_request_error`, code `model_not_found`, `param: model`) unless `model` is absent
    or the served model's id."""
    if model is not None and model != served:
        raise ModelNotFoundError(f"The model `{model}` does not exist; this server serves `{served}`", param="model")


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
