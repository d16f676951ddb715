"""Drives a `SegmentCache` from tests as the runtime's get-or-encode home does (`runtime.get_or_encode.SegmentEntries`:
look up, make what is missing, put it), with a synthetic encoder instead of a model: the cache only stores."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from hypic_rag.cache.keys import CacheNamespace
from hypic_rag.cache.segment_cache import SegmentCache

Made = Mapping[str, torch.Tensor]


def fetch_or_make_many(
    cache: SegmentCache, namespace: CacheNamespace | int, token_id_lists: Sequence[Sequence[int]],
    make_many: Callable[[list[list[int]]], Sequence[Made]],
) -> tuple[list[dict[str, torch.Tensor]], list[bool]]:
    """(entries, hits) in request order: `get_many`, then the distinct misses made by one `make_many` call and put
    with one `put_many` (as stored: what a later hit returns)."""
    requested = [[int(token) for token in ids] for ids in token_id_lists]
    found = cache.get_many(namespace, requested)
    hits = [entry is not None for entry in found]
    missing = list({tuple(ids): ids for ids, hit in zip(requested, hits) if not hit}.values())
    if missing:
        stored = dict(zip(map(tuple, missing), cache.put_many(namespace, missing, list(make_many(missing)))))
        found = [entry if entry is not None else stored[tuple(ids)] for ids, entry in zip(requested, found)]
    return found, hits  # type: ignore[return-value]


def fetch_or_make(
    cache: SegmentCache, namespace: CacheNamespace | int, token_ids: Sequence[int], make: Callable[[list[int]], Made]
) -> tuple[dict[str, torch.Tensor], bool]:
    """(entry, hit) of one token sequence (`fetch_or_make_many`)."""
    entries, hits = fetch_or_make_many(cache, namespace, [token_ids], lambda missing: [make(ids) for ids in missing])
    return entries[0], hits[0]
