"""The assembly modes, in one table: what each asks of the segment entries and of the stack pass.

The engine assembles by it, the benchmarks warm entries by it and precompute plans the entries a `hypic` request
needs by it (docs/runtime.md has the comparison ladder):

    mode             entries    chunk entry seam    reposition keys    composition
    full             -          -                   (yes)              (transition)
    prefix           -          -                   (yes)              (transition)
    addition         yes        0                   no                 addition
    transition       yes        0                   no                 transition
    transition_rope  yes        0                   yes                transition
    hypic            yes        w (seam_tokens)     yes                transition

`full` and `prefix` recompute every token they do not take from a prefix checkpoint, so the stack's defaults
(in brackets) apply. The prefix segment, always at position 0, is composed from its seam-0 entry in every mode
that uses entries (`PREFIX_ENTRY_SEAM`): with a zero start its entry is exact.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from hypic_rag.entry.schema import check_seam_tokens
from hypic_rag.errors import EXIT_BAD_INPUT, HypicError

PREFIX_ENTRY_SEAM = 0
"""The seam window of the prefix segment's entry: it sits at position 0, so its seam-0 entry is exact."""


class UnknownModeError(HypicError, ValueError):
    """A mode name that is not one of `MODES` (exit code 2; still a ValueError)."""

    exit_code = EXIT_BAD_INPUT


@dataclass(frozen=True, slots=True)
class ModeSpec:
    """One row of the mode table.

    uses_entries: the segments come from cached entries (False: recomputed, or from a prefix checkpoint).
    seam_repair: each chunk recomputes its first `seam_tokens` tokens (its entry is encoded for that seam window);
    otherwise chunk entries are seam-0 entries. reposition_keys: cached keys are rotated at their true positions.
    composition: "transition" applies P h + Z per cached span, "addition" applies h + Z.
    """

    name: str
    uses_entries: bool
    seam_repair: bool
    reposition_keys: bool
    composition: Literal["transition", "addition"]

    def entry_seam(self, seam_tokens: int) -> int | None:
        """The seam window of a chunk's entry in this mode (None: the mode uses no entries)."""
        if not self.uses_entries:
            return None
        return check_seam_tokens(seam_tokens) if self.seam_repair else 0

    def segment_seams(self, seam_tokens: int, *, has_prefix: bool, segments: int) -> list[int]:
        """The entry seam of each of a request's `segments` (the prefix first when `has_prefix`).

        The prefix is composed from its seam-0 entry; without a prefix the first chunk sits at position 0 and, in
        `hypic`, recomputes its seam from the zero start, which is exact too.
        """
        chunk_seam = self.entry_seam(seam_tokens)
        if chunk_seam is None:
            raise ValueError(f"mode {self.name!r} composes no segment entries")
        return [PREFIX_ENTRY_SEAM if has_prefix and number == 0 else chunk_seam for number in range(segments)]


MODE_TABLE: dict[str, ModeSpec] = {
    spec.name: spec
    for spec in (
        ModeSpec("full", uses_entries=False, seam_repair=False, reposition_keys=True, composition="transition"),
        ModeSpec("prefix", uses_entries=False, seam_repair=False, reposition_keys=True, composition="transition"),
        ModeSpec("addition", uses_entries=True, seam_repair=False, reposition_keys=False, composition="addition"),
        ModeSpec("transition", uses_entries=True, seam_repair=False, reposition_keys=False, composition="transition"),
        ModeSpec("transition_rope", uses_entries=True, seam_repair=False, reposition_keys=True,
                 composition="transition"),
        ModeSpec("hypic", uses_entries=True, seam_repair=True, reposition_keys=True, composition="transition"),
    )
}
MODES = tuple(MODE_TABLE)
"""The mode names, in table order."""


def mode_spec(mode: str) -> ModeSpec:
    """The table row of `mode`; `UnknownModeError` (a ValueError) naming the choices for any other name."""
    spec = MODE_TABLE.get(mode) if isinstance(mode, str) else None
    if spec is None:
        raise UnknownModeError(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}")
    return spec


def check_mode(mode: str) -> str:
    """`mode` if it is one of `MODES`, else `UnknownModeError`."""
    return mode_spec(mode).name


def entry_seams(modes: Iterable[str], seam_tokens: int) -> set[int]:
    """The chunk entry seams the given modes compose from (what warming a cache for them must encode)."""
    return {seam for seam in (mode_spec(mode).entry_seam(seam_tokens) for mode in modes) if seam is not None}
