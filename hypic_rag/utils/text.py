"""Checks on text that reaches a tokenizer."""

from __future__ import annotations


def unencodable_at(text: str) -> int | None:
    """Index of the first character of `text` that UTF-8 cannot encode, or None when there is none.

    Such characters are lone surrogates (U+D800..U+DFFF): JSON's `"\\ud800"` escape and undecodable command-line
    bytes produce them, and no tokenizer accepts them.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return error.start
    return None


def unencodable_message(text: str, what: str) -> str | None:
    """A one-line reason naming `what` when `text` holds a lone surrogate, else None."""
    position = unencodable_at(text)
    if position is None:
        return None
    return f"{what} holds a lone surrogate {text[position]!r} at character {position}; send valid Unicode text"
