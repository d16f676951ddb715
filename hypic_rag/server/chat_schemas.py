"""OpenAI-compatible bodies of `POST /v1/chat/completions`.

Messages take a string content (cut at the separator into parts) or a list of text parts; in a message of
several parts every part but the last is a document, cached as a segment (`hypic_rag.prompting.chat`). Sampling fields are
the completions route's (`openai_schemas.SamplingFields`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from hypic_rag.utils.limits import MAX_NEW_TOKENS
from hypic_rag.server.openai_schemas import (
    MAX_LOGPROBS,
    STRICT_IGNORING_EXTRA,
    CompletionUsage,
    HypicDetails,
    SamplingFields,
)
from hypic_rag.server.schemas import SourceOut, valid_unicode


class TextPart(BaseModel):
    """One content part; only text parts are taken."""

    model_config = STRICT_IGNORING_EXTRA

    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    model_config = STRICT_IGNORING_EXTRA

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _valid_unicode(cls, value: str | list[TextPart] | None) -> str | list[TextPart] | None:
        valid_unicode(value if not isinstance(value, list) else [part.text for part in value])
        return value


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=MAX_NEW_TOKENS.minimum, le=MAX_NEW_TOKENS.maximum,
                                   description="Deprecated by OpenAI for max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, ge=MAX_NEW_TOKENS.minimum, le=MAX_NEW_TOKENS.maximum)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    hypic: HypicDetails | None = None
    sources: list[SourceOut] | None = None
    """A chat over the index (`model` = the served id + `+index`): the retrieved chunks, best first."""


def chat_chunk(completion_id: str, created: int, model: str, index: int, delta: dict[str, Any],
               finish_reason: str | None) -> dict[str, Any]:
    """One streamed chat chunk (`chat.completion.chunk`) of choice `index`."""
    return {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
