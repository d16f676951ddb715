"""Checks that depend on the server's settings: empty input (400), unknown mode (400), sizes (413), bounds (422)."""

from __future__ import annotations

from typing import Any

from hypic_rag.runtime.modes import MODES
from hypic_rag.runtime.recompute_policy import RecomputePolicy, RecomputePolicyError
from hypic_rag.server.config import ServerConfig
from hypic_rag.server.errors import BadRequestError, PayloadTooLargeError, UnprocessableError


def checked_mode(mode: str) -> str:
    if mode not in MODES:
        raise BadRequestError(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}", param="mode")
    return mode


def checked_recompute_policy(spec: str | None) -> Any:
    """The request's recompute policy (None: the server's); 400 naming the forms for a bad spec."""
    if spec is None:
        return None
    try:
        return RecomputePolicy.parse(spec)
    except RecomputePolicyError as error:
        raise BadRequestError(str(error), param="recompute_policy") from None


def checked_question(question: str, config: ServerConfig) -> str:
    """The question stripped; 400 when empty, 413 when longer than the server accepts."""
    if len(question) > config.max_question_chars:
        raise PayloadTooLargeError(
            f"question has {len(question)} characters; this server accepts at most {config.max_question_chars}",
            param="question",
        )
    stripped = question.strip()
    if not stripped:
        raise BadRequestError("question is empty", param="question")
    return stripped


def checked_at_most(name: str, value: int, limit: int) -> int:
    if value > limit:
        raise UnprocessableError(f"{name}: must be at most {limit} on this server, got {value}", param=name)
    return value
