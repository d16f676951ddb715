"""Exceptions of the segment cache. Every message is one line, fit to show a user as is."""

from __future__ import annotations

import os
import shutil

from hypic_rag.errors import EXIT_BAD_INPUT, HypicError
from hypic_rag.utils.units import human_bytes


class CacheError(HypicError):
    """Base class of segment-cache errors (exit code 1; `hypic-rag cache` calls a cache it cannot open bad input,
    2, except a damaged one)."""


class CacheOpenError(CacheError):
    """The cache directory cannot be opened: missing, not a cache, not writable, or already open here."""


class CacheDamagedError(CacheOpenError):
    """The store's data file is damaged so that LMDB would crash the process reading it (shorter than its meta
    pages say: a truncated copy or a cut file). Found before the file is mapped; `hypic-rag cache clear`
    starts an empty store in its place."""


class CacheWriteError(CacheError):
    """A write transaction failed (disk full, I/O error): nothing of it was stored, earlier entries are intact."""


class CorruptEntryError(CacheError):
    """A stored value fails its checksum, is truncated, or cannot be decoded."""


class IncompatibleEntryError(CacheError):
    """A stored value is intact but written in another codec version (stale, not corrupt)."""


def free_space_note(path: str | os.PathLike[str]) -> str:
    """' (12.0 KiB free on its file system)' for `path` (or its nearest existing parent); '' if unknown.

    Appended to messages about failed writes, so that a full disk shows as such.
    """
    target = os.path.abspath(path)
    while not os.path.exists(target) and os.path.dirname(target) != target:
        target = os.path.dirname(target)
    try:
        free = shutil.disk_usage(target).free
    except OSError:
        return ""
    return f" ({human_bytes(free)} free on its file system)"


class RemoteTierConfigError(CacheError, ValueError):
    """The remote tier is configured wrongly (a URL that is not s3://BUCKET[/PREFIX], a bad option) or its client
    library (boto3, the ``remote`` extra) is not installed: bad input (exit 2). A remote that fails *at run time*
    raises nothing: its lookups are misses (see `remote_tier`)."""

    exit_code = EXIT_BAD_INPUT
