"""The root of the errors hypic-rag raises on purpose, and the exit codes they carry.

Every error meant for a user (a bad corpus, an index built for another model, a damaged cache, a model directory
that cannot load, a request the service refuses, ...) derives from `HypicError`; its message is one line, fit to
show as is, and `exit_code` is what `hypic-rag` exits with when the error reaches the command line
(`hypic_rag.cli.main` maps every `HypicError` there, once). A subclass sets `exit_code` as a class attribute;
the error families keep their own base classes too (`ModelLoadError` is still a `ValueError`, ...), so existing
`except` clauses keep catching them.

A leaf module: it imports nothing of the project, so every package may import it.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
"""Anything else went wrong: an unreadable index or cache, a locked index, a full disk, a worker that died."""
EXIT_BAD_INPUT = 2
"""The user gave something unusable: a missing path, an empty corpus or question, a model that cannot load, a bad
option (argparse errors exit 2 too)."""
EXIT_MISMATCH = 3
"""The index was built for another model, tokenizer, embedder or setting."""


class HypicError(Exception):
    """Base class of hypic-rag's user-facing errors: a one-line message and the exit code of the command line."""

    exit_code: int = EXIT_FAILURE


class MissingPathError(HypicError, FileNotFoundError):
    """A path the user named (a model or embedder directory) does not exist or is not what it should be.

    Still a `FileNotFoundError` (raised with the message only, so `str()` is the message, no errno prefix).
    """

    exit_code = EXIT_BAD_INPUT


class PromptTooLongError(HypicError, ValueError):
    """A prompt (or formatted chat) whose tokens and `max_new_tokens` do not fit the model's context window
    (`HypicLLM.metadata.context_window`), or that has more segments than `HypicLLM.max_segments`; raised by the
    LlamaIndex LLM before any model work. LlamaIndex's own engines fit their prompts to `context_window` (its
    `PromptHelper` repacks retrieved text): a direct call must shorten the prompt or drop chat history."""

    exit_code = EXIT_BAD_INPUT
