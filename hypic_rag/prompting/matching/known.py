"""What the matcher looks for: segments whose cached entries exist or will be reused (indexed chunks, seen segments).

A known segment is the exact text whose standalone token ids are its cache key (an indexed chunk formatted with
the prompt format's chunk template, `"{text}\\n"` by default; a segment a client sent explicitly), split into
`lead + core + trail` where the core is the segment stripped of surrounding whitespace. The matcher looks for the
core (whitespace-collapsed: `key`); the cut takes the lead and trail too when the prompt has them exactly, so the
piece cut out is the segment itself and its tokens are the cached ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hypic_rag.prompting.matching.normalise import collapse_whitespace

Origin = Literal["index", "seen"]


@dataclass(frozen=True, slots=True)
class KnownSegment:
    """segment: the exact text (its standalone tokens are the cache key); lead_chars / trail_chars: how many of its
    first / last characters surround the core (whitespace, or the chunk template's text around `{text}`); key: the
    core as matched (whitespace-collapsed unless matching is exact); origin: "index" (a chunk of the index or of an
    ingestion) or "seen" (a segment a request carried)."""

    segment: str
    lead_chars: int
    trail_chars: int
    key: str
    origin: Origin

    @classmethod
    def of(cls, segment: str, origin: Origin, *, core: str | None = None, collapse: bool = True) -> KnownSegment | None:
        """The known segment of `segment` (None when it holds no text). `core`: the part to match (an indexed
        chunk's text inside its formatted segment); default: `segment` stripped."""
        core = (segment if core is None else core).strip()
        if not core:
            return None
        lead = segment.find(core)
        if lead < 0:
            raise ValueError("the core must lie inside the segment")
        key = collapse_whitespace(core) if collapse else core
        return cls(segment, lead, len(segment) - lead - len(core), key, origin)

    @property
    def lead(self) -> str:
        return self.segment[: self.lead_chars]

    @property
    def core(self) -> str:
        return self.segment[self.lead_chars : len(self.segment) - self.trail_chars]

    @property
    def trail(self) -> str:
        return self.segment[len(self.segment) - self.trail_chars :]
