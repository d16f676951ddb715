"""`SegmentMatcher`: finds the text of known segments (indexed chunks, segments seen before) inside a prompt.

    matcher = SegmentMatcher(MatchConfig(min_chars=64))
    matcher.add_chunk(chunk_text, prompt_format.chunk(chunk_text))  # an indexed chunk and its cached segment
    matcher.add_seen(segment_text)                                  # a segment a request carried explicitly
    matches = matcher.find(prompt)        # non-overlapping `Match`es, in prompt order

How: every known core (the segment stripped, whitespace runs collapsed) is anchored by the hash of its first
`min_chars` characters. A prompt is collapsed the same way; the hash of every window of that width is computed at
once (`rolling.window_hashes`, linear in the prompt), windows whose hash is an anchor are candidates, and each
candidate is verified against the whole core (`str.startswith`, from that position). A match must not begin or
end inside a word of the prompt. Overlapping occurrences (a chunk inside another, two chunks sharing text) are
resolved by keeping the set that covers the most characters (weighted interval scheduling). `naive.py` is the
reference: every core searched with `str.find`.

Known cores sharing their first `min_chars` characters share an anchor, and each is verified at such a candidate:
a corpus whose chunks all begin alike pays one `startswith` per such chunk there.
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from hypic_rag.prompting.matching.known import KnownSegment, Origin
from hypic_rag.prompting.matching.normalise import NormalisedText
from hypic_rag.prompting.matching.rolling import text_codes, window_hashes

DEFAULT_MIN_CHARS = 64
"""Known cores shorter than this (whitespace collapsed) are not matched: too little to be worth a segment's seam,
and short text recurs by chance."""


@dataclass(frozen=True, slots=True)
class MatchConfig:
    """enabled: match at all (off: prompts are cut only at explicit separators, as before); min_chars: the
    shortest core matched, also the width of the hashed window; collapse_whitespace: match with whitespace runs
    collapsed (off: exact text only); seen_capacity: how many segments seen in requests are remembered (least
    recently matched forgotten first; indexed chunks are always kept); max_segments: a prompt that matching would
    cut into more segments than this (the query included) is cut only at its separators, as without matching
    (None: no limit; the service passes its `--max-segments`, so matching never makes a request too large).
    """

    enabled: bool = True
    min_chars: int = DEFAULT_MIN_CHARS
    collapse_whitespace: bool = True
    seen_capacity: int = 4096
    max_segments: int | None = None

    def __post_init__(self) -> None:
        if self.min_chars < 1:
            raise ValueError(f"min_chars must be positive, got {self.min_chars}")
        if self.seen_capacity < 0:
            raise ValueError(f"seen_capacity must be >= 0, got {self.seen_capacity}")
        if self.max_segments is not None and self.max_segments < 1:
            raise ValueError(f"max_segments must be positive, got {self.max_segments}")


@dataclass(frozen=True, slots=True)
class Occurrence:
    """A known core found in a normalised text: characters [start, end) of it."""

    start: int
    end: int
    key: str


@dataclass(frozen=True, slots=True)
class Match:
    """A known segment found in a prompt: its core spans characters [start, end) of the prompt; exact when those
    characters are the core itself (else they differ from it in whitespace only)."""

    start: int
    end: int
    known: KnownSegment
    exact: bool


def _wordy(character: str) -> bool:
    return character.isalnum() or character == "_"


def inside_word(text: str, start: int, end: int) -> bool:
    """Whether `text[start:end]` begins or ends inside a word of `text` (a letter, digit or _ on both sides of
    one of its ends)."""
    return (start > 0 and _wordy(text[start - 1]) and _wordy(text[start])) or (
        end < len(text) and _wordy(text[end - 1]) and _wordy(text[end])
    )


def select_occurrences(occurrences: Sequence[Occurrence]) -> list[Occurrence]:
    """The non-overlapping subset covering the most characters (weighted interval scheduling, O(m log m)); on a
    tie the occurrences ending first are kept. Returned in text order."""
    order = sorted(occurrences, key=lambda item: (item.end, item.start))
    ends = [item.end for item in order]
    best = [0] * (len(order) + 1)
    previous = [0] * (len(order) + 1)
    for number, item in enumerate(order, start=1):
        before = bisect_right(ends, item.start, 0, number - 1)  # those ending at or before its start
        previous[number] = before
        best[number] = max(best[number - 1], best[before] + item.end - item.start)
    chosen: list[Occurrence] = []
    number = len(order)
    while number > 0:
        if best[number] == best[number - 1]:
            number -= 1
        else:
            chosen.append(order[number - 1])
            number = previous[number]
    return chosen[::-1]


class SegmentMatcher:
    """Known segments and the anchors that find them in prompts (see the module docstring). Thread-safe."""

    def __init__(self, settings: MatchConfig = MatchConfig()) -> None:
        self.settings = settings
        self._known: dict[str, KnownSegment] = {}
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._anchors: dict[int, list[str]] = {}
        self._anchor_array = np.zeros(0, dtype=np.uint64)  # sorted anchor hashes (may hold forgotten ones)
        self._recent_anchors: set[int] = set()  # added since the array was last rebuilt
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._known)

    def counts(self) -> dict[str, int]:
        """Known segments by origin."""
        with self._lock:
            seen = len(self._seen)
            return {"index": len(self._known) - seen, "seen": seen}

    # ------------------------------------------------------------------------------------------- adding
    def add_chunk(self, text: str, segment: str) -> bool:
        """Know an indexed chunk: its `text` and the `segment` it is cached as (its text formatted with the chunk
        template). False when it is too short to be matched; ValueError when `text` is not inside `segment`."""
        return self._add(segment, "index", text)

    def add_chunks(self, chunks: Iterable[tuple[str, str]]) -> int:
        """`add_chunk` for each (text, segment); returns how many are matchable."""
        return sum(self.add_chunk(text, segment) for text, segment in chunks)

    def add_seen(self, segment: str) -> bool:
        """Know a segment a request carried explicitly (it is cached under its own tokens from now on). False when
        it is too short, or matching is off."""
        if not self.settings.enabled or self.settings.seen_capacity == 0:
            return False
        return self._add(segment, "seen", None)

    def _add(self, segment: str, origin: Origin, core: str | None) -> bool:
        known = KnownSegment.of(segment, origin, core=core, collapse=self.settings.collapse_whitespace)
        if known is None or len(known.key) < self.settings.min_chars:
            return False
        with self._lock:
            present = self._known.get(known.key)
            if present is not None:
                if present.origin == "seen" and origin == "index":  # the index's segment is the one cached
                    self._known[known.key] = known
                    del self._seen[known.key]
                elif present.origin == "seen":
                    self._seen.move_to_end(known.key)
                return True
            self._known[known.key] = known
            anchor = int(window_hashes(text_codes(known.key[: self.settings.min_chars]), self.settings.min_chars)[0])
            self._anchors.setdefault(anchor, []).append(known.key)
            self._recent_anchors.add(anchor)
            if origin == "seen":
                self._seen[known.key] = None
                while len(self._seen) > self.settings.seen_capacity:
                    self._forget(self._seen.popitem(last=False)[0])
        return True

    def _forget(self, key: str) -> None:
        """Drop a seen segment (its anchor hash stays in the array until it is rebuilt: a candidate that verifies
        nothing)."""
        del self._known[key]
        anchor = int(window_hashes(text_codes(key[: self.settings.min_chars]), self.settings.min_chars)[0])
        keys = self._anchors[anchor]
        keys.remove(key)
        if not keys:
            del self._anchors[anchor]
            self._recent_anchors.discard(anchor)

    # ------------------------------------------------------------------------------------------- finding
    def normalised(self, text: str) -> NormalisedText:
        return NormalisedText(text, collapse=self.settings.collapse_whitespace)

    def occurrences(self, normalised: NormalisedText) -> list[Occurrence]:
        """Every occurrence of a known core in `normalised.text` that does not begin or end inside a word,
        overlapping ones included."""
        text, width = normalised.text, self.settings.min_chars
        with self._lock:
            if not self._known or len(text) < width:
                return []
            hashes = window_hashes(text_codes(text), width)
            found: list[Occurrence] = []
            for position in np.flatnonzero(self._anchor_hits(hashes)).tolist():
                for key in self._anchors.get(int(hashes[position]), ()):
                    end = position + len(key)
                    if text.startswith(key, position) and not inside_word(text, position, end):
                        found.append(Occurrence(position, end, key))
            return found

    def _anchor_hits(self, hashes: np.ndarray) -> np.ndarray:
        """bool [n]: which of `hashes` are anchors. The sorted array is searched; anchors added since it was built
        are a small set searched on their own, merged into the array once they reach a sixteenth of it (so a
        request that adds a seen segment does not re-sort every anchor)."""
        if len(self._recent_anchors) > max(1024, len(self._anchor_array) // 16):
            self._anchor_array = np.unique(np.fromiter(self._anchors, dtype=np.uint64, count=len(self._anchors)))
            self._recent_anchors.clear()
        hits = np.zeros(hashes.shape, dtype=bool)
        for anchors in (self._anchor_array, np.sort(np.fromiter(self._recent_anchors, dtype=np.uint64))):
            if len(anchors):
                slots = np.minimum(np.searchsorted(anchors, hashes), len(anchors) - 1)
                hits |= anchors[slots] == hashes
        return hits

    def find(self, prompt: str) -> list[Match]:
        """The known segments in `prompt`: non-overlapping, covering the most characters, in prompt order (none
        when matching is off)."""
        if not self.settings.enabled:
            return []
        normalised = self.normalised(prompt)
        chosen = select_occurrences(self.occurrences(normalised))
        matches = []
        with self._lock:
            for item in chosen:
                known = self._known.get(item.key)
                if known is None:  # forgotten meanwhile
                    continue
                if known.key in self._seen:
                    self._seen.move_to_end(known.key)
                start, end = normalised.original_span(item.start, item.end)
                matches.append(Match(start, end, known, prompt[start:end] == known.core))
        return matches
