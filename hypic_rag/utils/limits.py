"""The ranges of the numbers and the limits on the text a user may send: one home for every surface.

The command line (argparse types in `hypic_rag.cli.common`), the REST bodies (`hypic_rag.server.schemas`, checked by
pydantic with these bounds), the calibration questions file and the library's own checks (policy specs, seams)
refuse the same values with the same words: the field's name, the range, the value. A number outside its range is
refused before it is used (never clamped, never wrapped), so a huge value is one line, not a traceback from deep
inside (an overflowing tensor, a 7 GB allocation).

Imports nothing of the project but two leaf modules (the entry format, `hypic_rag.utils.text`), so every part may use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypic_rag.entry.schema import MAX_SEAM_TOKENS
from hypic_rag.utils.text import unencodable_at

__all__ = [
    "CHUNK_TOKENS",
    "HOP_SLOTS",
    "MAX_NEW_TOKENS",
    "MAX_QUESTION_CHARS",
    "MAX_SEAM_TOKENS",
    "POLICY_BUDGET",
    "POLICY_CHUNKS",
    "POLICY_TOKENS",
    "SEAM_TOKENS",
    "SEED",
    "TOP_K",
    "NumberRange",
    "question_problem",
]


@dataclass(frozen=True, slots=True)
class NumberRange:
    """The values a number may take: `minimum`..`maximum` (both included unless `*_exclusive`); an integer unless
    `integer` is False (then any finite number; an integer is taken as a number)."""

    minimum: float
    maximum: float
    integer: bool = True
    minimum_exclusive: bool = False

    def describe(self) -> str:
        """"an integer in 1..256", "a number in 0..5", "a number in (0, 86400]"."""
        if self.integer:
            return f"an integer in {self.minimum}..{self.maximum}"
        if self.minimum_exclusive:
            return f"a number in ({self.minimum:g}, {self.maximum:g}]"
        return f"a number in {self.minimum:g}..{self.maximum:g}"

    def problem(self, value: object) -> str | None:
        """Why `value` is not in this range ("must be an integer in 1..256, got 0"), or None when it is."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be {self.describe()}, got {value!r}"
        if self.integer and not isinstance(value, int):
            return f"must be {self.describe()}, got {value!r}"
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be {self.describe()}, got {value!r}"
        below = value <= self.minimum if self.minimum_exclusive else value < self.minimum
        if below or value > self.maximum:
            return f"must be {self.describe()}, got {_shown(value)}"
        return None

    def check(self, value: object, name: str) -> object:
        """`value` when it is in range, else ValueError "`name` must be ...". """
        problem = self.problem(value)
        if problem is not None:
            raise ValueError(f"{name} {problem}")
        return value

    def parse(self, text: str) -> int | float:
        """`text` as a number of this range, or ValueError saying what it must be (non-numeric, non-finite, out of
        range, an integer of thousands of digits: all one message)."""
        text = text.strip()
        value: int | float
        try:
            if len(text) > 40:  # no number of a range here has 40 digits: refuse before int() works on it
                raise ValueError
            value = int(text) if self.integer else float(text)
        except ValueError:
            raise ValueError(f"must be {self.describe()}, got {text[:40]!r}{'...' if len(text) > 40 else ''}") from None
        problem = self.problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value


def _shown(value: int | float) -> str:
    """A number as an error message shows it: a huge integer cut to its first digits and its length."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:12]}... ({len(text)} digits)"


SEAM_TOKENS = NumberRange(0, MAX_SEAM_TOKENS)
"""A seam window w (tokens recomputed at a chunk's start); a seam at least as long as a chunk recomputes it whole."""
CHUNK_TOKENS = NumberRange(1, 65_536)
"""Tokens per chunk (precompute's --chunk-tokens)."""
POLICY_CHUNKS = NumberRange(1, 4_096)
"""N of a `whole:N` recompute policy: chunks recomputed whole (more than a request holds: all of them)."""
POLICY_BUDGET = NumberRange(1, 10_000, integer=False)
"""X of a `budget:X` recompute policy: a multiple of the seam plan's recomputed chunk tokens."""
POLICY_TOKENS = NumberRange(1, 1 << 24)
"""N of a `tokens:N` recompute policy: chunk tokens recomputed per request."""
TOP_K = NumberRange(1, 256)
"""Chunks retrieved for one question."""
HOP_SLOTS = NumberRange(0, 256)
"""Of the top-k places, those that go to the retrieval hop."""
MAX_NEW_TOKENS = NumberRange(1, 65_536)
"""Tokens one answer may generate (a server's own limit may be lower)."""
SEED = NumberRange(0, 2**64 - 1)
"""A sampling seed: an unsigned 64-bit integer."""

MAX_QUESTION_CHARS = 4_000
"""The longest question, in characters, on every surface: `ask` (argument or standard input), the calibration
questions file, `/v1/ask` (a server may set its own `max_question_chars`)."""


def question_problem(text: str, limit: int = MAX_QUESTION_CHARS) -> str | None:
    """Why `text` cannot be a question (longer than `limit` characters, holding a lone surrogate, empty), or None."""
    if len(text) > limit:
        return f"has {len(text)} characters; at most {limit} are accepted"
    surrogate = unencodable_at(text)
    if surrogate is not None:
        return f"holds a lone surrogate {text[surrogate]!r} at character {surrogate}; send valid Unicode text"
    if not text.strip():
        return "is empty"
    return None
