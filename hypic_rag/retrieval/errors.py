"""Errors raised by the retrieval layer. Each carries a message meant for the user, printed as one line."""

from __future__ import annotations

from hypic_rag.errors import EXIT_BAD_INPUT, EXIT_MISMATCH, HypicError


class RetrievalError(HypicError):
    """Base class: a user-facing problem with a corpus or an index (never a bug); exit code 1 unless a subclass
    says otherwise."""


class CorpusNotFoundError(RetrievalError):
    """The corpus path does not exist."""

    exit_code = EXIT_BAD_INPUT


class EmptyCorpusError(RetrievalError):
    """The corpus holds no readable document with text."""

    exit_code = EXIT_BAD_INPUT


class IndexMismatchError(RetrievalError):
    """An existing index was built with another embedder, model, tokenizer or chunker setting."""

    exit_code = EXIT_MISMATCH


class IndexNotFoundError(RetrievalError):
    """The index directory holds no index (no manifest)."""

    exit_code = EXIT_BAD_INPUT


class IndexCorruptError(RetrievalError):
    """The index directory exists but its files cannot be read back."""


class IndexLockedError(RetrievalError):
    """Another process holds the index's writer lock (a precompute, or a server that is not --read-only)."""


class IndexWriteError(RetrievalError):
    """Writing the index failed (disk full, I/O error); what was stored before is intact."""


class IndexLocationError(RetrievalError):
    """The index or segment cache path cannot be used: a file, a place inside a file, an unwritable place."""

    exit_code = EXIT_BAD_INPUT
