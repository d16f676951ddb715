"""Text with its whitespace runs collapsed, mapped back to the original characters.

Matching is done on the collapsed text, so a chunk whose line breaks or spaces differ from the prompt's (a
client that reflowed it, LlamaIndex stripping a node's text) is still found; the positions found are mapped back
to the prompt's own characters, where it is cut.
"""

from __future__ import annotations

import re
from bisect import bisect_right

_RUN = re.compile(r"\S+")


def collapse_whitespace(text: str) -> str:
    """`text` with every whitespace run made one space and both ends stripped."""
    return " ".join(_RUN.findall(text))


class NormalisedText:
    """`original` as matching sees it: with `collapse`, whitespace runs collapsed (`collapse_whitespace`); without,
    the text itself. `text` is that form; `original_span` maps a span of it back to `original`."""

    __slots__ = ("original", "text", "_starts", "_original_starts")

    def __init__(self, original: str, *, collapse: bool = True) -> None:
        self.original = original
        if not collapse:
            self.text = original
            self._starts: list[int] | None = None
            self._original_starts: list[int] = []
            return
        runs = list(_RUN.finditer(original))
        self.text = " ".join(run.group() for run in runs)
        starts, position = [], 0
        for run in runs:
            starts.append(position)
            position += len(run.group()) + 1
        self._starts = starts
        self._original_starts = [run.start() for run in runs]

    def original_span(self, start: int, end: int) -> tuple[int, int]:
        """The span of `original` that `text[start:end]` stands for; the span must begin and end on a
        non-whitespace character (what every match does: its text is stripped)."""
        if self._starts is None:
            return start, end
        first = bisect_right(self._starts, start) - 1
        last = bisect_right(self._starts, end - 1) - 1
        return (self._original_starts[first] + start - self._starts[first],
                self._original_starts[last] + end - self._starts[last])
