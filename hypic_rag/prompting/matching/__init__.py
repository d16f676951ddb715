"""Reuse without separators: find indexed chunks and seen segments inside a plain prompt and cut it there.

A client that pastes retrieved text into its prompt (LlamaIndex's own query engines, an OpenAI-style client, a
chat UI) sends no `<<PIC_SEP>>`; the prompt still holds each chunk verbatim (or with its whitespace changed). The
`SegmentMatcher` (`matcher.py`) knows the text of every indexed chunk and of every segment a request carried
explicitly, finds them in a prompt in time linear in its length (hashed windows, `rolling.py`; the reference is
`naive.py`), and `segment_prompt` (`cutting.py`) cuts the prompt's text there and tokenizes each piece on its own,
exactly as the separated path does, so each chunk's cached entry is reused and the text between chunks is a
segment of its own. Explicit separators are honoured first: matching only cuts the text the client left unmarked.
"""

from hypic_rag.prompting.matching.cutting import (
    NO_MATCHING,
    Piece,
    PromptSegment,
    SegmentedPrompt,
    cut_around,
    segment_prompt,
    separated_pieces,
)
from hypic_rag.prompting.matching.known import KnownSegment
from hypic_rag.prompting.matching.matcher import Match, MatchConfig, Occurrence, SegmentMatcher, select_occurrences

__all__ = [
    "NO_MATCHING",
    "KnownSegment",
    "Match",
    "MatchConfig",
    "Occurrence",
    "Piece",
    "PromptSegment",
    "SegmentMatcher",
    "SegmentedPrompt",
    "cut_around",
    "segment_prompt",
    "select_occurrences",
    "separated_pieces",
]
