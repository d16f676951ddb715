"""A prompt cut into segments: at explicit separators first, then around the known segments the matcher finds.

    pieces = separated_pieces(prompt.split("<<PIC_SEP>>"))     # parts the client marked, then the query part
    prompt = segment_prompt(tokenizer, pieces, matcher=matcher, prefix=prompt_format.prefix)
    prompt.request            # the Request the engine assembles; prompt.texts: each segment's text

A piece is either *explicit* (a segment the client marked: kept whole, its text remembered as a seen segment) or
*searchable* (text the client left unmarked: the query part of a completion prompt, the chat template's text
around documents, each message of the LlamaIndex LLM's chat). A searchable piece is cut around every match: the
match's segment (its core, plus the lead and trail of its known segment where the prompt has them exactly, so the
piece is the cached segment itself) and the text between matches, each its own segment. Every segment is then
tokenized on its own, exactly as the separated path does, so a prompt cut by matching gives the same request, and
the same answer, as the same prompt with separators at those places (`SegmentedPrompt.separated`).

A match whose text differs from the known segment's only in whitespace stands for the known text: its segment is
the known one (so its cached entry is used), and the prompt's whitespace inside it is not kept.

The last segment is the query, always recomputed: a match with nothing after it is left in the query. When at
least one match was found, or the first explicit part is exactly the prompt format's prefix, a prompt beginning
with that prefix gets it as the request's prefix segment (position 0, its exact seam-0 entry, as `/v1/ask` and
`HypicQueryEngine` compose it). A prompt with no match is cut only at its separators, as before. The query's
trailing spaces are taken off and left out of the answer's start (`prompt.split_trailing_space`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hypic_rag.prompting.layout import tokenize_query, tokenize_segment
from hypic_rag.prompting.matching.matcher import Match, SegmentMatcher
from hypic_rag.runtime.request import Request

logger = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class Piece:
    """Prompt text and whether it is an explicit segment (kept whole) or searchable (cut around matches)."""

    text: str
    explicit: bool = False


def separated_pieces(parts: Sequence[str]) -> list[Piece]:
    """A separated prompt's parts as pieces: all but the last explicit, the last (the query part) searchable."""
    return [Piece(part, explicit=True) for part in parts[:-1]] + [Piece(parts[-1])] if parts else []


@dataclass(frozen=True, slots=True)
class PromptSegment:
    """One segment's text and the known segment it was matched to (None: explicit, or text between matches)."""

    text: str
    match: Match | None = None


def cut_around(text: str, matches: Sequence[Match]) -> list[PromptSegment]:
    """`text` cut around `matches` (non-overlapping, in order): the text before each match, the match's segment
    (its known segment's lead and trail included where `text` has them exactly; for a whitespace-only match the
    known text in place of the prompt's), and the text after the last one. Empty texts are left out."""
    cut: list[PromptSegment] = []
    cursor = 0
    for number, match in enumerate(matches):
        known = match.known
        start, end = match.start, match.end
        lead, trail = known.lead_chars, known.trail_chars
        if lead and start - lead >= cursor and text[start - lead : start] == known.lead:
            start -= lead
        limit = matches[number + 1].start if number + 1 < len(matches) else len(text)
        if trail and end + trail <= limit and text[end : end + trail] == known.trail:
            end += trail
        body = text[start:end]
        if not match.exact:
            body = text[start : match.start] + known.core + text[match.end : end]
        if start > cursor:
            cut.append(PromptSegment(text[cursor:start]))
        cut.append(PromptSegment(body, match))
        cursor = end
    if cursor < len(text):
        cut.append(PromptSegment(text[cursor:]))
    return cut


@dataclass(frozen=True, slots=True)
class SegmentedPrompt:
    """A prompt's request and how it was cut.

    request: what the engine assembles; texts: the text of each of `request.segments` (the prefix first when it
    has one), then the query's; matched: per `request.segments`, whether the matcher found it.
    """

    request: Request
    texts: tuple[str, ...]
    matched: tuple[bool, ...]

    @property
    def matched_segments(self) -> int:
        return sum(self.matched)

    @property
    def matched_tokens(self) -> int:
        """Prompt tokens inside matched segments."""
        return sum(len(ids) for ids, hit in zip(self.request.segments, self.matched) if hit)

    def separated(self, separator: str) -> str:
        """The same prompt with `separator` at every cut: sent that way it gives this request again (the prefix
        segment too, being the first part)."""
        return separator.join(self.texts)

    def matching_usage(self, segment_cached_tokens: Sequence[int]) -> dict[str, int]:
        """segments (the request's, the query included), matched_segments, matched_tokens and
        matched_cached_tokens (the matched segments' tokens that came from entries held before the request), given
        the prefill's tokens reused per segment (`vocabulary.MATCHING_FIELDS`)."""
        cached = sum(tokens for tokens, hit in zip(segment_cached_tokens, self.matched) if hit)
        return {"segments": len(self.request.segments) + 1, "matched_segments": self.matched_segments,
                "matched_tokens": self.matched_tokens, "matched_cached_tokens": cached}


NO_MATCHING = {"matched_segments": 0, "matched_tokens": 0, "matched_cached_tokens": 0}
"""`SegmentedPrompt.matching_usage` of a request built without matching."""


def segment_prompt(
    tokenizer: Any, pieces: Sequence[Piece], *, matcher: SegmentMatcher | None = None, prefix: str = ""
) -> SegmentedPrompt:
    """The request of `pieces` (the last holds the query): explicit pieces kept whole (and remembered by
    `matcher` as seen segments), searchable ones cut around `matcher`'s matches (none without a matcher); see the
    module docstring for the query and the prefix. Each segment is tokenized on its own; empty ones are dropped.

    ValueError when there are no pieces, the query is empty, or text holds a lone surrogate."""
    if not pieces:
        raise ValueError("no segments given")
    cut: list[PromptSegment] = []
    found = False
    last = len(pieces) - 1
    for number, piece in enumerate(pieces):
        if piece.explicit or matcher is None:
            cut.append(PromptSegment(piece.text))
            continue
        matches = matcher.find(piece.text)
        piece_cut = cut_around(piece.text, matches)
        if number == last and piece_cut and piece_cut[-1].match is not None:
            piece_cut = cut_around(piece.text, matches[:-1])  # nothing after it: it stays in the query
        found = found or any(item.match is not None for item in piece_cut)
        cut.extend(piece_cut if piece_cut or number < last else [PromptSegment(piece.text)])
    limit = matcher.settings.max_segments if matcher is not None else None
    if found and limit is not None and sum(bool(item.text) for item in cut) > limit:
        logger.warning("matching would cut the prompt into more than %d segments; it is cut at its separators only",
                       limit)
        return segment_prompt(tokenizer, pieces, matcher=None, prefix=prefix)
    with_prefix = False
    if prefix and len(cut) > 1 and cut[0].match is None:
        first = cut[0].text
        if first == prefix and (pieces[0].explicit or found):
            with_prefix = True
        elif found and not pieces[0].explicit and first.startswith(prefix):
            cut[0:1] = [PromptSegment(prefix), PromptSegment(first[len(prefix) :])]
            with_prefix = True
    *before, query = cut
    cached = [(tokenize_segment(tokenizer, item.text, f"segment {number}"), item) for number, item in enumerate(before)]
    query_ids, answer_lead = tokenize_query(tokenizer, query.text, f"segment {len(before)}")
    if not query_ids:
        raise ValueError("the last segment (the query) is empty")
    prefix_ids = cached.pop(0)[0] if with_prefix else []
    cached = [(ids, item) for ids, item in cached if ids]
    if matcher is not None:
        for piece in pieces[:-1]:
            if piece.explicit:
                matcher.add_seen(piece.text)
    request = Request(prefix_ids=prefix_ids, chunk_ids=[ids for ids, _ in cached], question_ids=query_ids,
                      answer_lead=answer_lead)
    texts = ([prefix] if with_prefix else []) + [item.text for _, item in cached] + [query.text]
    matched = ([False] if with_prefix else []) + [item.match is not None for _, item in cached]
    return SegmentedPrompt(request, tuple(texts), tuple(matched))
