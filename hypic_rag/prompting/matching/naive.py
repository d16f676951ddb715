"""The reference of `SegmentMatcher.occurrences`: every known core searched in the text with `str.find`.

Quadratic in the number of known segments times the text length; tests compare the fast matcher with it on
random texts."""

from __future__ import annotations

from collections.abc import Iterable

from hypic_rag.prompting.matching.matcher import Occurrence, inside_word


def occurrences_naive(text: str, keys: Iterable[str]) -> list[Occurrence]:
    """Every occurrence (overlapping ones too) of each key in `text` that does not begin or end inside a word."""
    found = []
    for key in set(keys):
        position = text.find(key)
        while position >= 0:
            if not inside_word(text, position, position + len(key)):
                found.append(Occurrence(position, position + len(key), key))
            position = text.find(key, position + 1)
    return found
