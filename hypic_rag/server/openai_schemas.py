"""OpenAI-compatible bodies of `POST /v1/completions` and `GET /v1/models`.

The request takes OpenAI's fields (unknown ones are ignored, as OpenAI clients send many) plus two extensions:
`mode` (assembly mode, default hypic) and `separator` (what splits the prompt into segments; the server's
default when absent). Defaults follow OpenAI: 16 tokens, temperature 1.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hypic_rag.server.schemas import SEED_DESCRIPTION, SEED_MAX, valid_unicode


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="Accepted for compatibility; the server's one model answers.")
    prompt: str | list[str] = Field(
        description="Segments separated by the separator (default <<PIC_SEP>>); the last segment is the query."
    )
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description=SEED_DESCRIPTION)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    user: str | None = None
    mode: str = Field("hypic", description="hypic-rag extension: the assembly mode.")
    separator: str | None = Field(None, min_length=1, description="hypic-rag extension: the segment separator.")

    _valid_unicode = field_validator("prompt", "stop", "mode", "separator")(valid_unicode)


class CompletionChoice(BaseModel):
    text: str
    index: int = 0
    logprobs: None = None
    finish_reason: str | None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens reused from before this request (segment-cache hits).")


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class HypicDetails(BaseModel):
    """hypic-rag extension: how the prompt was assembled and where the time went (milliseconds)."""

    mode: str
    segments: int
    encoded_tokens: int = Field(description="Prompt tokens from segment entries encoded during this request.")
    recomputed_tokens: int = Field(description="Prompt tokens run through the model while assembling.")
    cache_hits: int
    cache_misses: int
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


def chunk_payload(completion_id: str, created: int, model: str, text: str, finish_reason: str | None) -> dict[str, Any]:
    """One streamed completion chunk, as OpenAI sends it."""
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}],
    }
