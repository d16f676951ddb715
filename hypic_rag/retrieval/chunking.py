"""Split documents into chunks measured in the model's own tokens.

A chunk's stored `token_ids` are the ids of its *formatted segment*, `prompt_format.chunk(text)`, tokenized on its
own without special tokens: exactly the segment the runtime consumes (see `hypic_rag/prompting/layout.py`). The cache key is
built from these ids, so nothing downstream ever re-tokenizes a chunk. `chunk_tokens` bounds that segment's length.

Boundaries: the text is cut into units (sentences, and lines, inside paragraphs); units are packed greedily into a
chunk, which is closed at the first paragraph end once it is `paragraph_fill` full; when the next unit does not fit,
at its last paragraph end if that is at least half as full, else at the last sentence end that fits. A unit longer than a whole chunk is split at whitespace near the token limit (or between tokens when a
window holds no whitespace). Closing at paragraph ends makes boundaries re-align after an edit, so editing one
paragraph usually changes only the chunks around it.

Chunk ids are derived from content: sha256 of the document id and the chunk text. Re-ingesting the same text gives
the same ids (and the same token ids, hence the same cache entries); identical text repeated inside one document
is kept once.

`Chunker.iter_chunks` produces the chunks lazily, so a very large document is chunked in bounded pieces of work
(the service advances ingestion jobs one step at a time between requests): units are found and counted a batch at
a time, as the packing reaches them, and a unit longer than `LONG_UNIT_CHARS_PER_TOKEN` characters per token of
the content budget (a "sentence" of thousands of characters without a sentence end or a newline) is first cut at
whitespace into windows of that size, so no single tokenizer call covers more than one window.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hypic_rag.prompting.layout import DEFAULT_PROMPT_FORMAT, PromptFormat, tokenize_segment
from hypic_rag.retrieval.parsers import location_metadata
from hypic_rag.retrieval.loading import Document

logger = logging.getLogger(__name__)

CHUNKER_VERSION = 1
MIN_CHUNK_TOKENS = 8
UNIT_BATCH = 64
"""Units found and token-counted together when the packing needs more (fewer when they are long)."""
LONG_UNIT_CHARS_PER_TOKEN = 64
"""A unit longer than this many characters per token of the content budget is cut into windows of that size."""

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
    char_start / char_end: the text's span in the document. metadata: where in the document the span lies
    (`page` / `page_end` of a PDF, `section` of HTML, DOCX or Markdown; `formats.location_metadata`).
    """

    chunk_id: str
    doc_id: str
    position: int
    text: str
    token_ids: tuple[int, ...]
    char_start: int
    char_end: int
    metadata: dict[str, Any] = field(default_factory=dict)

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
    """Token ids of one prompt segment, tokenized on its own without special tokens (`prompting.layout.tokenize_segment`)."""
    return tokenize_segment(tokenizer, text)


def _trimmed(text: str, start: int, end: int) -> tuple[int, int] | None:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return (start, end) if start < end else None


def _paragraph_spans(text: str) -> Iterator[tuple[int, int]]:
    start = 0
    for match in _PARAGRAPH_BREAK.finditer(text):
        yield start, match.start()
        start = match.end()
    yield start, len(text)


def _unit_spans(text: str, paragraph_start: int, paragraph_end: int) -> Iterator[tuple[int, int]]:
    """Sentences and lines of one paragraph, trimmed, in order."""
    line_start = paragraph_start
    while line_start < paragraph_end:
        newline = text.find("\n", line_start, paragraph_end)
        line_end = paragraph_end if newline < 0 else newline + 1
        cut = line_start
        for match in _SENTENCE_END.finditer(text, line_start, line_end):
            span = _trimmed(text, cut, match.end())
            if span:
                yield span
            cut = match.end()
        span = _trimmed(text, cut, line_end)
        if span:
            yield span
        line_start = line_end


def iter_units(text: str) -> Iterator[_Unit]:
    """Sentences and lines of `text` in order, with paragraph ends marked; found as they are consumed."""
    for paragraph_start, paragraph_end in _paragraph_spans(text):
        previous: tuple[int, int] | None = None
        for span in _unit_spans(text, paragraph_start, paragraph_end):
            if previous is not None:
                yield _Unit(previous[0], previous[1], paragraph_end=False)
            previous = span
        if previous is not None:
            yield _Unit(previous[0], previous[1], paragraph_end=True)


def split_units(text: str) -> list[_Unit]:
    """Sentences and lines of `text` in order, with paragraph ends marked."""
    return list(iter_units(text))


def _char_windows(text: str, unit: _Unit, max_chars: int) -> Iterator[_Unit]:
    """`unit` cut into pieces of at most `max_chars` characters, at the last whitespace of each window when it
    lies in the window's second half; the last piece keeps the unit's paragraph end."""
    previous: tuple[int, int] | None = None
    start = unit.start
    while start < unit.end:
        end = min(unit.end, start + max_chars)
        if end < unit.end:
            space = max(text.rfind(" ", start, end), text.rfind("\n", start, end))
            if space > start + max_chars // 2:
                end = space
        span = _trimmed(text, start, end)
        if span:
            if previous is not None:
                yield _Unit(previous[0], previous[1], paragraph_end=False)
            previous = span
        start = end
    if previous is not None:
        yield _Unit(previous[0], previous[1], paragraph_end=unit.paragraph_end)


class _FittedUnits:
    """A document's units, each within the content budget, with their token counts, produced on demand.

    `units` and `counts` grow a batch at a time when `has(index)` asks beyond them; the chunker may replace a
    unit by tighter pieces in place.
    """

    def __init__(self, chunker: Chunker, text: str) -> None:
        self._chunker = chunker
        self._text = text
        self._max_chars = max(1, chunker.content_budget * LONG_UNIT_CHARS_PER_TOKEN)
        self._source = self._bounded_units()
        self.units: list[_Unit] = []
        self.counts: list[int] = []

    def _bounded_units(self) -> Iterator[_Unit]:
        for unit in iter_units(self._text):
            if unit.end - unit.start > self._max_chars:
                yield from _char_windows(self._text, unit, self._max_chars)
            else:
                yield unit

    def has(self, index: int) -> bool:
        """Whether the document has a unit at `index` (producing units up to it if needed)."""
        while index >= len(self.units):
            if not self._extend():
                return False
        return True

    def _extend(self) -> bool:
        raw: list[_Unit] = []
        chars = 0
        for unit in self._source:  # a batch: UNIT_BATCH units, or fewer holding a long unit's window of text
            raw.append(unit)
            chars += unit.end - unit.start
            if len(raw) >= UNIT_BATCH or chars >= self._max_chars:
                break
        if not raw:
            return False
        text, chunker = self._text, self._chunker
        counts = chunker._count_tokens([text[unit.start : unit.end] for unit in raw])
        for unit, count in zip(raw, counts, strict=True):
            if count <= chunker.content_budget:
                self.units.append(unit)
                self.counts.append(count)
            else:
                pieces = chunker._split_long_unit(text, unit, chunker.content_budget)
                self.units.extend(pieces)
                self.counts.extend(chunker._count_tokens([text[piece.start : piece.end] for piece in pieces]))
        return True


class Chunker:
    """Cuts documents into chunks of at most `config.chunk_tokens` segment tokens with the model's tokenizer."""

    def __init__(
        self, tokenizer: Any, config: ChunkerConfig | None = None, prompt_format: PromptFormat = DEFAULT_PROMPT_FORMAT,
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

    def _greedy_end(self, fitted: _FittedUnits, first: int) -> int:
        """One past the last unit of the chunk that starts at unit `first` (by approximate token counts).

        The chunk closes at the first paragraph end once `paragraph_fill` full; when the next unit does not fit,
        it closes at its last paragraph end if that is at least half of `paragraph_fill` full, else at the last
        sentence that fits.
        """
        units, counts = fitted.units, fitted.counts
        total, end = 0, first
        close_at = self.config.paragraph_fill * self.content_budget
        fallback_end = None
        while fitted.has(end) and total + counts[end] <= self.content_budget:
            total += counts[end]
            end += 1
            if units[end - 1].paragraph_end:
                if total >= close_at:
                    return end
                if total >= close_at / 2:
                    fallback_end = end
        if fitted.has(end) and fallback_end is not None:
            return fallback_end
        return max(end, first + 1)

    def chunk_document(self, document: Document) -> list[Chunk]:
        """The document's chunks in order (identical chunk texts kept once)."""
        return [chunk for chunk in self.chunk_steps(document) if chunk is not None]

    def chunk_steps(self, document: Document) -> Iterator[Chunk | None]:
        """The document's chunks in order, produced lazily, one item per chunk cut: the chunk, or None where its
        text repeats an earlier chunk's (kept once). The work behind one item is bounded (a batch of units
        counted, one chunk tokenized) whatever the document's size."""
        text = document.text
        fitted = _FittedUnits(self, text)
        units, counts = fitted.units, fitted.counts
        seen_ids: set[str] = set()
        position = 0
        first = 0
        while fitted.has(first):
            end = self._greedy_end(fitted, first)
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
                yield None
            else:
                seen_ids.add(chunk_id)
                yield Chunk(
                    chunk_id=chunk_id,
                    doc_id=document.doc_id,
                    position=position,
                    text=chunk_text,
                    token_ids=tuple(token_ids),
                    char_start=start_char,
                    char_end=end_char,
                    metadata=location_metadata(document.locations, start_char, end_char),
                )
                position += 1
            first = end
