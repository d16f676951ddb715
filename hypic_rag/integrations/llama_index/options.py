"""Keyword options checked by name: an unknown (misspelt) option is an error that names it, never ignored."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["refuse_unknown_options"]


def refuse_unknown_options(owner: str, given: Mapping[str, Any], accepted: Iterable[str], hint: str = "") -> None:
    """Raise TypeError naming every option of `given` that `owner` does not take, with the closest accepted name
    ("did you mean ...?") and the full list; `hint` (when given) ends the message. Nothing happens when all
    options are known."""
    known = sorted(set(accepted))
    unknown = [name for name in given if name not in known]
    if not unknown:
        return
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    noun = "option" if len(unknown) == 1 else "options"
    message = f"{owner} got an unknown {noun} {', '.join(parts)}; it takes: {', '.join(known)}"
    raise TypeError(message + (f". {hint}" if hint else ""))
