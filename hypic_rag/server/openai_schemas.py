"""OpenAI-compatible bodies of `POST /v1/completions` and `GET /v1/models` (chat: `chat_schemas.py`).

The request takes OpenAI's fields (unknown ones are ignored, as OpenAI clients send many), vLLM's `top_k`, plus two
extensions: `mode` (assembly mode, default hypic) and `separator` (what splits the prompt into segments; the
server's default when absent). Defaults follow OpenAI: 16 tokens, temperature 1. Invalid fields are answered 400
on these routes, as vLLM does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hypic_rag.utils.limits import MAX_NEW_TOKENS
from hypic_rag.server.schemas import SEED_DESCRIPTION, SEED_MAX, valid_unicode

STRICT_IGNORING_EXTRA = ConfigDict(extra="ignore", strict=True)
"""OpenAI's bodies: unknown fields ignored (clients send many), known ones never coerced from another JSON type
(`"match_segments": "no"` is a 400 naming the field, as OpenAI and vLLM answer, not false)."""


class StreamOptions(BaseModel):
    model_config = STRICT_IGNORING_EXTRA

    include_usage: bool = False


MAX_CHOICES = 16
"""The most choices (`n`) one request may ask for."""
MAX_LOGPROBS = 20
"""The most alternatives per token `logprobs` / `top_logprobs` may ask for (vLLM's default `max_logprobs`)."""
MAX_SAMPLING_TOP_K = 1 << 20
"""vLLM's `top_k`: more than any vocabulary holds keeps every token."""
TOKEN_ID_DIGITS = 12
"""The longest token id a `logit_bias` key may spell (the model's vocabulary is checked later)."""


class SamplingFields(BaseModel):
    """Sampling fields shared by completions and chat (OpenAI's, and vLLM's `top_k`)."""

    model_config = STRICT_IGNORING_EXTRA

    model: str | None = Field(None, description="The served model's id (`GET /v1/models`); another id is a 404.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, le=MAX_SAMPLING_TOP_K,
                              description="vLLM extension: keep the k most likely tokens (-1, 0: all).")
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="Choices per prompt.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description=SEED_DESCRIPTION)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = Field(None, description="Token id (as a string) -> bias in -100..100.")
    user: str | None = None
    mode: str = Field("hypic", description="hypic-rag extension: the assembly mode.")
    separator: str | None = Field(None, min_length=1, description="hypic-rag extension: the segment separator.")
    match_segments: bool | None = Field(
        None, description="hypic-rag extension: cut the prompt around the indexed chunks and seen segments it holds "
        "(None: the server's setting, on unless started with --no-segment-matching).")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        """A field sent as null takes its default: OpenAI's spec makes every optional parameter nullable
        (`"max_tokens": null`, `"temperature": null`), clients send such nulls, and vLLM takes them."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @field_validator("logit_bias")
    @classmethod
    def _valid_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not token.strip().isdigit() or len(token.strip()) > TOKEN_ID_DIGITS:
                raise ValueError(f"keys are token ids (at most {TOKEN_ID_DIGITS} digits), got {token[:40]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases lie in -100..100, got {bias!r} for token {token}")
        return value


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="A string whose segments are separated by the separator (default <<PIC_SEP>>; the last "
        "segment is the query), token ids (one recomputed query), or a list of either (several prompts)."
    )
    max_tokens: int = Field(16, ge=MAX_NEW_TOKENS.minimum, le=MAX_NEW_TOKENS.maximum)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    suffix: str | None = None

    _valid_unicode = field_validator("prompt", "stop", "mode", "separator")(valid_unicode)


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    text: str
    index: int = 0
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens reused from before this request (segment-cache hits).")


class CompletionUsage(BaseModel):
    """OpenAI's usage, with hypic-rag's counters under the names every surface uses (`hypic_rag.pipeline.vocabulary`):
    cached + encoded + recomputed = prompt tokens."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    cached_tokens: int = Field(description="hypic-rag extension: prompt tokens reused from before this request "
                                           "(as in prompt_tokens_details, where OpenAI's clients read it).")
    encoded_tokens: int = Field(
        description="hypic-rag extension: prompt tokens from segment entries encoded during this request."
    )
    recomputed_tokens: int = Field(description="hypic-rag extension: prompt tokens run through the model while "
                                               "assembling (seams, the query).")
    cache_hits: int = Field(description="hypic-rag extension: segments found in the cache.")
    cache_misses: int = Field(description="hypic-rag extension: segments encoded for this request (and stored).")
    segments: int = Field(description="hypic-rag extension: segments the prompt was cut into, the query included.")
    matched_segments: int = Field(description="hypic-rag extension: segments found by matching the prompt's text "
                                              "against indexed chunks and seen segments.")
    matched_tokens: int = Field(description="hypic-rag extension: prompt tokens inside matched segments.")
    matched_cached_tokens: int = Field(description="hypic-rag extension: of matched_tokens, those reused from "
                                                   "entries held before this request (seams excluded).")


class HypicDetails(BaseModel):
    """hypic-rag extension: the assembly mode and where the time went (milliseconds); the token and segment
    counts are in `usage`."""

    mode: str
    timings: dict[str, float]


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None
    hypic: HypicDetails | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hypic-rag"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """OpenAI's `stop` as a tuple of non-empty strings."""
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else list(stop)
    return tuple(item for item in items if item)


def chunk_payload(
    completion_id: str, created: int, model: str, text: str, finish_reason: str | None, index: int = 0
) -> dict[str, Any]:
    """One streamed completion chunk of choice `index`, as OpenAI sends it."""
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"text": text, "index": index, "logprobs": None, "finish_reason": finish_reason}],
    }
