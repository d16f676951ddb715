"""Prompts given as separated segments (OpenAI completions, the LlamaIndex LLM): split, tokenize each on its own.

Every part but the last is a segment whose cached entry is reused wherever it lands; the last part is the query,
always recomputed. Segments are tokenized separately, never as one string, so a segment's token ids (its cache
key) do not depend on what surrounds it. A first part that is exactly the prompt format's prefix (when one is
given) is the request's prefix segment, composed from its exact seam-0 entry as `/v1/ask` does. Used by the
service and the integrations alike (neither imports the other); prompts without separators are cut around the
chunks they contain by `hypic_rag.prompting.matching`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypic_rag.prompting.matching.cutting import segment_prompt, separated_pieces
from hypic_rag.runtime.request import Request

DEFAULT_SEPARATOR = "<<PIC_SEP>>"
"""What separates the segments of a prompt unless told otherwise."""


def split_segments(prompt: str, separator: str) -> list[str]:
    """`prompt` cut at every `separator`; a prompt without one is a single (query) segment."""
    if not separator:
        raise ValueError("the separator must be a non-empty string")
    return prompt.split(separator)


def segmented_request(tokenizer: Any, segments: Sequence[str], prefix: str = "") -> Request:
    """A request whose cached segments are `segments[:-1]` (empty ones dropped) and whose query is the last one;
    a first segment equal to a non-empty `prefix` is the prefix segment.

    Raises ValueError when the query segment has no tokens or a segment holds a lone surrogate.
    """
    return segment_prompt(tokenizer, separated_pieces(list(segments)), prefix=prefix).request
