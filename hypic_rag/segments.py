"""Prompts given as separated segments (OpenAI completions, the LlamaIndex LLM): split, tokenize each on its own.

Every part but the last is a segment whose cached entry is reused wherever it lands; the last part is the query,
always recomputed. Segments are tokenized separately, never as one string, so a segment's token ids (its cache
key) do not depend on what surrounds it. Used by the service and the integrations alike (neither imports the
other).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypic_rag.prompt import tokenize_segment
from hypic_rag.runtime.request import Request

DEFAULT_SEPARATOR = "<<PIC_SEP>>"
"""What separates the segments of a prompt unless told otherwise."""


def split_segments(prompt: str, separator: str) -> list[str]:
    """`prompt` cut at every `separator`; a prompt without one is a single (query) segment."""
    if not separator:
        raise ValueError("the separator must be a non-empty string")
    return prompt.split(separator)


def segmented_request(tokenizer: Any, segments: Sequence[str]) -> Request:
    """A request whose cached segments are `segments[:-1]` (empty ones dropped) and whose query is the last one.

    Raises ValueError when the query segment has no tokens or a segment holds a lone surrogate.
    """
    if not segments:
        raise ValueError("no segments given")
    ids = [tokenize_segment(tokenizer, text, f"segment {number}") for number, text in enumerate(segments)]
    if not ids[-1]:
        raise ValueError("the last segment (the query) is empty")
    return Request(prefix_ids=[], chunk_ids=[segment for segment in ids[:-1] if segment], question_ids=ids[-1])
