"""Split documents into chunks measured in the model's own tokens.

A chunk's stored `token_ids` are the ids of its *formatted segment*, `prompt_format.chunk(text)`, tokenized on its
own without special tokens: exactly the segment the runtime consumes (see `hypic_rag/prompt.py`). The cache key is
built from these ids, so nothing downstream ever re-tokenizes a chunk. `chunk_tokens` bounds that segment's length.

Boundaries: the text is cut into units (sentences, and lines, inside paragraphs); units are packed greedily into a
chunk, which is closed at the first paragraph end once it is `paragraph_fill` full; when the next unit does not fit,
at its last paragraph end if that is at least half as full, else at the last sentence end that fits. A unit longer than a whole chunk is split at whitespace near the token limit (or between tokens when a
window holds no whitespace). Closing at paragraph ends makes boundaries re-align after an edit, so editing one
paragraph usually changes only the chunks around it.

Chunk ids are derived from content: sha256 of the document id and the chunk text. Re-ingesting the same text gives
the same ids (and the same token ids, hence the same cache entries); identical text repeated inside one document
is kept once.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hypic_rag.prompt import DEFAULT_PROMPT_FORMAT, PromptFormat
from hypic_rag.retrieval.loading import Document

logger = logging.getLogger(__name__)

CHUNKER_VERSION = 1
MIN_CHUNK_TOKENS = 8

_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n\s*")
_SENTENCE_END = re.compile(r"[.!?\u2026\u3002\uff01\uff1f]+[\"'\u201d\u2019)\]]*(?=\s)")


@dataclass(frozen=True, slots=True)
class ChunkerConfig:
    """How documents are cut.

    chunk_tokens: most tokens of a chunk's formatted segment (default 256).
    paragraph_fill: a chunk is closed at the first paragraph end once it holds this fraction of chunk_tokens.
    """

    chunk_tokens: int = 256
    paragraph_fill: float = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens < MIN_CHUNK_TOKENS:
            raise ValueError(f"chunk_tokens must be an integer >= {MIN_CHUNK_TOKENS}, got {self.chunk_tokens!r}")
        if not 0.0 <= self.paragraph_fill <= 1.0:
            raise ValueError(f"paragraph_fill must be in [0, 1], got {self.paragraph_fill!r}")

    def to_dict(self) -> dict[str, Any]:
        """Settings that decide chunk boundaries (stored in the index manifest)."""
        return {"version": CHUNKER_VERSION, "chunk_tokens": self.chunk_tokens, "paragraph_fill": self.paragraph_fill}


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk of a document.

    chunk_id: content-derived id. position: its order in the document. text: the chunk's raw text (what is
    embedded and shown as a source). token_ids: ids of the formatted chunk segment (what is cached and composed).
    char_start / char_end: the text's span in the document.
    """

    chunk_id: str
    doc_id: str
    position: int
    text: str
    token_ids: tuple[int, ...]
    char_start: int
    char_end: int

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class _Unit:
    """A sentence or line of a document: its span and whether a paragraph ends after it."""

    start: int
    end: int
    paragraph_end: bool


def chunk_id_for(doc_id: str, text: str) -> str:
    """The stable, content-derived id of a chunk."""
    return hashlib.sha256(f"{doc_id}\0{text}".encode("utf-8")).hexdigest()[:32]


def encode_segment_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of one prompt segment, tokenized on its own without special tokens."""
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def _trimmed(text: str, start: int, end: int) -> tuple[int, int] | None:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return (start, end) if start < end else None


def _paragraph_spans(text: str) -> list[tuple[int, int]]:
    spans, start = [], 0
    for match in _PARAGRAPH_BREAK.finditer(text):
        spans.append((start, match.start()))
        start = match.end()
    spans.append((start, len(text)))
    return spans


def split_units(text: str) -> list[_Unit]:
    """Sentences and lines of `text` in order, with paragraph ends marked."""
    units: list[_Unit] = []
    for paragraph_start, paragraph_end in _paragraph_spans(text):
        paragraph_units: list[tuple[int, int]] = []
        line_start = paragraph_start
        while line_start < paragraph_end:
            newline = text.find("\n", line_start, paragraph_end)
            line_end = paragraph_end if newline < 0 else newline + 1
            cut = line_start
            for match in _SENTENCE_END.finditer(text, line_start, line_end):
                span = _trimmed(text, cut, match.end())
                if span:
                    paragraph_units.append(span)
                cut = match.end()
            span = _trimmed(text, cut, line_end)
            if span:
                paragraph_units.append(span)
            line_start = line_end
        for index, (start, end) in enumerate(paragraph_units):
            units.append(_Unit(start, end, paragraph_end=index == len(paragraph_units) - 1))
    return units


class Chunker:
    """Cuts documents into chunks of at most `config.chunk_tokens` segment tokens with the model's tokenizer."""

    def __init__(
        self,
        tokenizer: Any,
        config: ChunkerConfig | None = None,
        prompt_format: PromptFormat = DEFAULT_PROMPT_FORMAT,
    ) -> None:
        self.tokenizer = tokenizer
        self.config = config or ChunkerConfig()
        self.prompt_format = prompt_format
        overhead = len(encode_segment_text(tokenizer, prompt_format.chunk("")))
        self.content_budget = self.config.chunk_tokens - overhead
        if self.content_budget < 1:
            raise ValueError(
                f"chunk_tokens={self.config.chunk_tokens} leaves no room for text: the chunk template alone takes "
                f"{overhead} tokens"
            )

    def _count_tokens(self, texts: Sequence[str]) -> list[int]:
        if not texts:
            return []
        encoded = self.tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
        return [len(ids) for ids in encoded]

    def _split_long_unit(self, text: str, unit: _Unit, max_tokens: int) -> list[_Unit]:
        """Cut one over-long unit into pieces of at most `max_tokens` tokens, at whitespace where possible."""
        piece_text = text[unit.start : unit.end]
        offsets = self.tokenizer(
            piece_text, add_special_tokens=False, return_offsets_mapping=True, verbose=False
        )["offset_mapping"]
        pieces: list[_Unit] = []
        token = 0
        while token < len(offsets):
            window_start = offsets[token][0]
            if len(offsets) - token <= max_tokens:
                cut = len(piece_text)
            else:
                hard_cut = offsets[token + max_tokens][0]
                space = max(piece_text.rfind(" ", window_start, hard_cut), piece_text.rfind("\n", window_start, hard_cut))
                cut = space if space > window_start + (hard_cut - window_start) // 2 else hard_cut
                cut = max(cut, offsets[token][1])  # always make progress
            span = _trimmed(text, unit.start + window_start, unit.start + cut)
            if span:
                pieces.append(_Unit(span[0], span[1], paragraph_end=False))
            while token < len(offsets) and offsets[token][0] < cut:
                token += 1
        if pieces:
            last = pieces[-1]
            pieces[-1] = _Unit(last.start, last.end, paragraph_end=unit.paragraph_end)
        return pieces

    def _fitting_units(self, text: str) -> tuple[list[_Unit], list[int]]:
        """The document's units, long ones split, with their token counts."""
        units = split_units(text)
        counts = self._count_tokens([text[unit.start : unit.end] for unit in units])
        fitted: list[_Unit] = []
        for unit, count in zip(units, counts, strict=True):
            if count <= self.content_budget:
                fitted.append(unit)
            else:
                fitted.extend(self._split_long_unit(text, unit, self.content_budget))
        return fitted, self._count_tokens([text[unit.start : unit.end] for unit in fitted])

    def _greedy_end(self, units: list[_Unit], counts: list[int], first: int) -> int:
        """One past the last unit of the chunk that starts at unit `first` (by approximate token counts).

        The chunk closes at the first paragraph end once `paragraph_fill` full; when the next unit does not fit,
        it closes at its last paragraph end if that is at least half of `paragraph_fill` full, else at the last
        sentence that fits.
        """
        total, end = 0, first
        close_at = self.config.paragraph_fill * self.content_budget
        fallback_end = None
        while end < len(units) and total + counts[end] <= self.content_budget:
            total += counts[end]
            end += 1
            if units[end - 1].paragraph_end:
                if total >= close_at:
                    return end
                if total >= close_at / 2:
                    fallback_end = end
        if end < len(units) and fallback_end is not None:
            return fallback_end
        return max(end, first + 1)

    def chunk_document(self, document: Document) -> list[Chunk]:
        """The document's chunks in order (identical chunk texts kept once)."""
        text = document.text
        units, counts = self._fitting_units(text)
        chunks: list[Chunk] = []
        seen_ids: set[str] = set()
        first = 0
        while first < len(units):
            end = self._greedy_end(units, counts, first)
            while True:
                start_char, end_char = units[first].start, units[end - 1].end
                chunk_text = text[start_char:end_char]
                token_ids = encode_segment_text(self.tokenizer, self.prompt_format.chunk(chunk_text))
                excess = len(token_ids) - self.config.chunk_tokens
                if excess <= 0:
                    break
                if end - first > 1:
                    end -= 1
                    continue
                # a single unit still too long once formatted: split it tighter and retry
                pieces = self._split_long_unit(text, units[first], max(1, counts[first] - excess - 1))
                if len(pieces) < 2:
                    logger.warning("document %s: a chunk of %d tokens could not be split", document.doc_id, len(token_ids))
                    break
                units[first : first + 1] = pieces
                counts[first : first + 1] = self._count_tokens([text[piece.start : piece.end] for piece in pieces])
                end = first + 1
            chunk_id = chunk_id_for(document.doc_id, chunk_text)
            if chunk_id in seen_ids:
                logger.debug("document %s: repeated chunk text at char %d kept once", document.doc_id, start_char)
            else:
                seen_ids.add(chunk_id)
                chunks.append(
                    Chunk(
                        chunk_id=chunk_id,
                        doc_id=document.doc_id,
                        position=len(chunks),
                        text=chunk_text,
                        token_ids=tuple(token_ids),
                        char_start=start_char,
                        char_end=end_char,
                    )
                )
            first = end
        return chunks
