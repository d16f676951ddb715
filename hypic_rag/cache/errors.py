"""Exceptions of the segment cache. Every message is one line, fit to show a user as is."""

from __future__ import annotations


class CacheError(Exception):
    """Base class of segment-cache errors."""


class CacheOpenError(CacheError):
    """The cache directory cannot be opened: missing, not a cache, not writable, or already open here."""


class CorruptEntryError(CacheError):
    """A stored value fails its checksum, is truncated, or cannot be decoded."""


class IncompatibleEntryError(CacheError):
    """A stored value is intact but written in another codec version (stale, not corrupt)."""
