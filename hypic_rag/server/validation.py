"""Checks that depend on the server's settings: empty input (400), unknown mode or recompute policy (400), sizes
(413), bounds (422)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from hypic_rag.runtime.modes import MODES
from hypic_rag.runtime.recompute_policy import RecomputePolicy, RecomputePolicyError
from hypic_rag.server.config import ServerConfig
from hypic_rag.server.errors import BadRequestError, PayloadTooLargeError, UnprocessableError


def checked_mode(mode: str) -> str:
    if mode not in MODES:
        raise BadRequestError(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}", param="mode")
    return mode


def checked_recompute_policy(spec: str | None, entry_seams: Collection[int] | None = None,
                             longest_chunk: int = 0) -> Any:
    """The request's recompute policy (None: the server's); 400 naming the forms (and a number's range) for a bad
    spec, and for a seam whose entries the index does not hold (`entry_seams`) unless it is at least
    `longest_chunk` long (then every chunk is recomputed whole and no entry is read).

    What a client may make the server store is so bounded: entries of the seams the index was built for, at most
    one per retrieved chunk (`top_k`) or prompt segment (`max_segments`)."""
    if spec is None:
        return None
    try:
        policy = RecomputePolicy.parse(spec)
    except RecomputePolicyError as error:
        raise BadRequestError(str(error), param="recompute_policy") from None
    seam = policy.seam_tokens
    if entry_seams is not None and seam is not None and seam not in entry_seams and seam < longest_chunk:
        held = ", ".join(str(width) for width in sorted(entry_seams))
        raise BadRequestError(
            f"recompute_policy {spec[:40]!r}: this index holds entries for seam {held} only; name that seam, or one of "
            f"at least {longest_chunk} (its longest chunk: every chunk recomputed whole), or none (the server's)",
            param="recompute_policy",
        )
    return policy


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
