"""The persistent segment source of the runtime: hot tier, then disk store, then the shared remote tier (when
given). It only stores: what it lacks is encoded by the runtime's get-or-encode home
(`hypic_rag.runtime.get_or_encode.SegmentEntries`) and put back.

    cache = SegmentCache.open(directory, namespace=CacheNamespace.for_model(model, seam_tokens=8))
    engine = Engine(model, segment_source=cache)            # the runtime sees a `SegmentSource`
    held = cache.contains_many(8, token_id_lists)           # a seam width: the bound namespace at that width
    entries = cache.get_many(namespace, token_id_lists)     # or any namespace, given explicitly; None: a miss
    stored = cache.put_many(namespace, token_id_lists, encoded_entries)
    removed = cache.remove_many(namespace, token_id_lists)

Opened with a `namespace`, the cache is bound to it: given a seam width instead of a namespace, the methods use
that namespace at that width (`CacheNamespace.with_seam`), which is how the runtime's `SegmentSource` calls them.

An entry is a plain ``dict[str, torch.Tensor]`` (docs/CONTRACTS.md); returned tensors may be shared with the hot
tier, so treat them as read-only. A hit requires the entry's recorded namespace and its stored ``token_ids`` to
equal the request; a corrupt entry (checksum, truncation, undecodable) or a mismatched one is logged, counted,
removed and reported as a miss (so the get-or-encode home recomputes it), never returned. Entries are handed out in their stored form: the namespace's cache format
(`hypic_rag.entry`; ``float32``: as encoded, ``int8``, ``int4``, ...: codes and scales), which the runtime
decodes once per hit on the device it uses the entry on (`decompress_entry`); the hot tier holds that form too.
A put returns the stored form a later hit would return, so answers do not depend on whether the cache was warm.

With ``best_effort=True`` (ask, serve: the cache only saves work) a damaged store is replaced by a `NullStore`
(the cache is disabled, with a warning) and a failed write (disk full) is logged instead of raised; without it
(precompute, whose job is to fill the cache) both raise `CacheDamagedError` / `CacheWriteError`.

With a `remote_tier.RemoteTier` (``remote=``), lookups the local tiers miss are asked of the remote; a remote hit is
verified like a disk hit (a bad object is deleted there, counted and recomputed) and fills the hot tier and the
disk store; every entry put here is also written to the remote (write-behind). The remote never raises: when
it fails its lookups are misses. A read-only cache writes nowhere, the remote included.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hypic_rag.cache.codec import decode_entry, encode_entry, read_header
from hypic_rag.cache.errors import CacheDamagedError, CacheWriteError, CorruptEntryError, IncompatibleEntryError
from hypic_rag.cache.hot_tier import HotTier
from hypic_rag.cache.keys import CacheNamespace, key_label, segment_key
from hypic_rag.cache.lmdb_store import LmdbSegmentStore
from hypic_rag.cache.stats import CacheStats
from hypic_rag.cache.store import NullStore, PutRequest, SegmentStore
from hypic_rag.entry.schema import TOKEN_IDS, Entry, entry_bytes

if TYPE_CHECKING:
    from hypic_rag.cache.remote_tier import RemoteTier

log = logging.getLogger(__name__)

DEFAULT_HOT_BUDGET_BYTES = 512 << 20


@dataclass(slots=True)
class _LookupTally:
    corrupt: int = 0
    mismatched: int = 0


class SegmentCache:
    """Hot tier (in-process LRU by bytes) over a `SegmentStore` (LMDB on disk), over an optional shared
    `RemoteTier`. Use `open`; close when done (the cache closes its remote tier too).

    namespace: what a seam width given instead of a namespace is resolved in; the runtime's
    `hypic_rag.runtime.segment_source.SegmentSource` protocol is met structurally (the cache imports nothing from
    the runtime).
    """

    def __init__(
        self, store: SegmentStore, hot_tier: HotTier, *, best_effort: bool = False,
        namespace: CacheNamespace | None = None, remote: RemoteTier | None = None,
    ) -> None:
        self.store = store
        self.hot_tier = hot_tier
        self.best_effort = best_effort
        self.namespace = namespace
        self.remote = remote
        # a read-only cache writes nowhere; a disabled (damaged) disk store still lets the remote tier be written
        self._remote_writable = remote is not None and (not store.readonly or isinstance(store, NullStore))
        self._hot_hits = 0
        self._disk_hits = 0
        self._remote_hits = 0
        self._remote_misses = 0

    @classmethod
    def open(
        cls, directory: str | os.PathLike[str], *, disk_budget_bytes: int | None = None,
        hot_budget_bytes: int = DEFAULT_HOT_BUDGET_BYTES, readonly: bool = False, best_effort: bool = False,
        namespace: CacheNamespace | None = None, remote: RemoteTier | None = None,
    ) -> SegmentCache:
        """Open or create the cache in `directory` (read-only: must exist; misses are computed, not stored),
        bound to `namespace` (needed by the `SegmentSource` methods only), over the shared `remote` tier if given
        (the cache owns it from here on and closes it).

        Raises `CacheOpenError` with a one-line reason for a missing, foreign, unwritable or busy directory, and
        its subclass `CacheDamagedError` for a damaged store, unless `best_effort`: then the cache runs without
        its disk tier (a `NullStore`; logged as a warning) and failed writes are logged, not raised.
        """
        store: SegmentStore
        try:
            store = LmdbSegmentStore.open(directory, budget_bytes=disk_budget_bytes, readonly=readonly)
        except CacheDamagedError as error:
            if not best_effort:
                raise
            log.warning("segment cache disabled, answers are computed without it: %s", error)
            store = NullStore(Path(directory), str(error))
        except BaseException:
            if remote is not None:
                remote.close()
            raise
        return cls(store, HotTier(hot_budget_bytes), best_effort=best_effort, namespace=namespace, remote=remote)

    @property
    def disabled_reason(self) -> str | None:
        """Why the disk tier is off (a damaged store opened with ``best_effort``), else None."""
        return self.store.reason if isinstance(self.store, NullStore) else None

    def namespace_for(self, seam_tokens: int) -> CacheNamespace:
        """The bound namespace at seam window `seam_tokens`; ValueError when the cache was opened without one."""
        if self.namespace is None:
            raise ValueError("this segment cache was opened without a namespace; pass namespace= to SegmentCache.open")
        return self.namespace.with_seam(seam_tokens)

    def _resolve(self, namespace: CacheNamespace | int) -> CacheNamespace:
        """`namespace` itself, or for a seam width the bound namespace at that width (`namespace_for`)."""
        return self.namespace_for(namespace) if isinstance(namespace, int) else namespace

    def check_model(self, model_fingerprint: str, tokenizer_fingerprint: str) -> None:
        """Return if the bound namespace is this model's; ValueError otherwise (or when there is none), so that an
        engine is never given a cache bound to another model."""
        namespace = self.namespace
        if namespace is None:
            raise ValueError("this segment cache was opened without a namespace; pass namespace= to SegmentCache.open")
        if (namespace.model_fingerprint, namespace.tokenizer_fingerprint) != (model_fingerprint, tokenizer_fingerprint):
            raise ValueError(
                f"this segment cache is bound to model {namespace.model_fingerprint[:12]}, "
                f"not {model_fingerprint[:12]}; open it with CacheNamespace.for_model(model, ...)"
            )

    # ------------------------------------------------------------------------------------------- storage
    def contains_many(self, namespace: CacheNamespace | int, token_id_lists: Sequence[Sequence[int]]) -> list[bool]:
        """Whether an entry of each token sequence is held, on disk or in the remote tier (asked for those the disk
        lacks; a remote that fails holds nothing here). Nothing is read, decoded or counted."""
        namespace = self._resolve(namespace)
        keys = [segment_key(namespace, ids) for ids in token_id_lists]
        held = self.store.batched_contains(keys)
        lacking = [position for position, found in enumerate(held) if not found]
        if lacking and self.remote is not None:
            for position, found in zip(lacking, self.remote.contains_many([keys[p] for p in lacking])):
                held[position] = found
        return held

    def stored_bytes(self, namespace: CacheNamespace, token_id_lists: Sequence[Sequence[int]]) -> int:
        """Bytes the store holds for these token sequences' entries (encoded values; absent ones count 0)."""
        sizes = (self.store.value_bytes(segment_key(namespace, ids)) for ids in token_id_lists)
        return sum(size or 0 for size in sizes)

    def get_many(self, namespace: CacheNamespace | int, token_id_lists: Sequence[Sequence[int]]) -> list[Entry | None]:
        """The cached entries of these token sequences in request order, None for a miss (nothing is computed): hot
        tier, disk, then the remote tier. A corrupt, stale or mismatched entry is logged, counted, removed and
        None. Hits and misses are recorded in the store's counters."""
        tally = _LookupTally()
        found = self._lookup(self._resolve(namespace), [[int(token) for token in ids] for ids in token_id_lists], tally)
        held = sum(entry is not None for entry in found)
        self.store.record_lookups(hits=held, misses=len(found) - held, corrupt=tally.corrupt, mismatched=tally.mismatched)
        return found

    def put_many(
        self, namespace: CacheNamespace | int, token_id_lists: Sequence[Sequence[int]],
        entries: Sequence[Mapping[str, torch.Tensor]],
    ) -> list[Entry]:
        """Store freshly encoded entries of these token sequences in one transaction (and hand them to the remote
        tier, write-behind); returns each as a later hit returns it (in the namespace's cache format). ValueError
        when the counts differ or an entry's token_ids are not its sequence's."""
        if len(entries) != len(token_id_lists):
            raise ValueError(f"{len(entries)} entries given for {len(token_id_lists)} token sequences")
        namespace = self._resolve(namespace)
        requests: list[PutRequest] = []
        returned: list[Entry] = []
        for ids, entry in zip(token_id_lists, entries):
            key, stored_form, value = stored_value(namespace, [int(token) for token in ids], entry)
            sizes = entry_bytes(stored_form)
            requests.append(PutRequest(key, value, sizes.linear_bytes, sizes.kv_bytes))
            returned.append(dict(stored_form))
            self.hot_tier.put(key, returned[-1])
        if not self.store.readonly:
            self._tolerate_write_failure(lambda: self.store.batched_put(requests))
        if self.remote is not None and self._remote_writable:
            self.remote.put_many([(request.key, request.value) for request in requests])
        return returned

    def _lookup(
        self, namespace: CacheNamespace, requested: list[list[int]], tally: _LookupTally
    ) -> list[Entry | None]:
        """Hot tier first, then one disk snapshot for the rest; bad disk entries are dropped and counted."""
        keys = [segment_key(namespace, ids) for ids in requested]
        found: list[Entry | None] = [None] * len(keys)
        disk_positions: dict[bytes, list[int]] = {}
        hot_keys: list[bytes] = []
        for position, (key, ids) in enumerate(zip(keys, requested)):
            entry = self.hot_tier.get(key)
            if entry is not None and _same_token_ids(entry, ids):
                found[position] = entry
                hot_keys.append(key)
                self._hot_hits += 1
            else:
                disk_positions.setdefault(key, []).append(position)
        if hot_keys:
            self.store.touch(hot_keys)  # a hot hit is a use of the disk copy too
        if not disk_positions:
            return found
        disk_keys = list(disk_positions)
        values = self.store.batched_get(disk_keys)
        bad_keys: list[bytes] = []
        remote_positions: dict[bytes, list[int]] = {}
        for key, value in zip(disk_keys, values):
            if value is None:
                remote_positions[key] = disk_positions[key]
                continue
            ids = requested[disk_positions[key][0]]
            entry = self._decode_stored(namespace, key, ids, value, tally, where=str(self.store.path))
            if entry is None:
                bad_keys.append(key)
                remote_positions[key] = disk_positions[key]
                continue
            self.hot_tier.put(key, entry)
            for position in disk_positions[key]:
                found[position] = dict(entry)
                self._disk_hits += 1
        if bad_keys and not self.store.readonly:
            self._tolerate_write_failure(lambda: self.store.batched_remove(bad_keys))
        if remote_positions and self.remote is not None:
            self._lookup_remote(namespace, requested, remote_positions, found, tally)
        return found

    def _lookup_remote(
        self, namespace: CacheNamespace, requested: list[list[int]], positions: dict[bytes, list[int]],
        found: list[Entry | None], tally: _LookupTally,
    ) -> None:
        """Ask the remote tier for what the local tiers lack; verified hits fill the hot tier and the disk store
        (one write), bad objects are discarded there. Fills `found` in place."""
        assert self.remote is not None
        keys = list(positions)
        values = self.remote.get_many(keys)
        fills: list[PutRequest] = []
        bad: dict[bytes, bool] = {}  # key -> corrupt (else mismatched or stale)
        for key, value in zip(keys, values):
            if value is None:
                self._remote_misses += len(positions[key])
                continue
            ids = requested[positions[key][0]]
            corrupt_before = tally.corrupt
            decoded = self._decode_stored(namespace, key, ids, value, tally, where=self.remote.url)
            if decoded is None:
                bad[key] = tally.corrupt > corrupt_before
                self._remote_misses += len(positions[key])
                continue
            sizes = entry_bytes(decoded)
            fills.append(PutRequest(key, value, sizes.linear_bytes, sizes.kv_bytes))
            entry = decoded
            self.hot_tier.put(key, entry)
            for position in positions[key]:
                found[position] = dict(entry)
                self._remote_hits += 1
        for corrupt in (True, False):
            discarded = [key for key, is_corrupt in bad.items() if is_corrupt == corrupt]
            if discarded and self._remote_writable:
                self.remote.discard(discarded, corrupt=corrupt)
        if fills and not self.store.readonly:
            self._tolerate_write_failure(lambda: self.store.batched_put(fills))

    def _decode_stored(
        self, namespace: CacheNamespace, key: bytes, token_ids: list[int], value: bytearray, tally: _LookupTally,
        *, where: str,
    ) -> Entry | None:
        """The tensors of `value` as stored (views of it), or None when it is corrupt, stale or another
        namespace's or token sequence's (logged, counted in `tally`). `where`: the store it came from."""
        try:
            decoded = decode_entry(value)
        except CorruptEntryError as error:
            log.warning("corrupt cache entry %s in %s (%s); recomputing it", key_label(key), where, error)
            tally.corrupt += 1
            return None
        except IncompatibleEntryError as error:
            log.info("stale cache entry %s in %s (%s); recomputing it", key_label(key), where, error)
            tally.mismatched += 1
            return None
        if decoded.namespace != namespace.canonical() or not _same_token_ids(decoded.tensors, token_ids):
            log.warning("cache entry %s in %s belongs to another namespace or token sequence; recomputing it",
                        key_label(key), where)
            tally.mismatched += 1
            return None
        return decoded.tensors

    def _tolerate_write_failure(self, write: Callable[[], object]) -> None:
        """Run a store write; with ``best_effort`` a `CacheWriteError` (disk full) is logged, not raised: the
        entries were computed and are returned anyway, only not kept on disk."""
        try:
            write()
        except CacheWriteError as error:
            if not self.best_effort:
                raise
            log.warning("%s; going on without storing these entries", error)

    # ------------------------------------------------------------------------------------------- admin
    def stats(self) -> dict[str, int | float | str]:
        """Store-wide counts and sizes plus this process's hot tier; see `CacheStats`."""
        stats = CacheStats.from_store(
            self.store,
            hot_entries=len(self.hot_tier),
            hot_bytes=self.hot_tier.bytes,
            hot_budget_bytes=self.hot_tier.budget_bytes,
            hot_evictions=self.hot_tier.evictions,
            hot_hits=self._hot_hits,
            disk_hits=self._disk_hits,
        )
        result = stats.as_dict()
        if self.namespace is not None:
            result["cache_format"] = self.namespace.cache_format
        if self.disabled_reason is not None:
            result["disabled"] = self.disabled_reason
        if self.remote is not None:
            result.update(self.remote.stats())
            result["remote_hits"] = self._remote_hits
            result["remote_misses"] = self._remote_misses
        return result

    def remove_many(self, namespace: CacheNamespace | int, token_id_lists: Sequence[Sequence[int]]) -> int:
        """Remove these token sequences' entries of `namespace` from the hot tier and the disk store (a cache
        rebuilt in another format drops the old format's entries); the number removed from disk. The remote tier
        keeps its objects (its lifecycle rules age them out); a read-only cache removes nothing from disk."""
        namespace = self._resolve(namespace)
        keys = list(dict.fromkeys(segment_key(namespace, ids) for ids in token_id_lists))
        for key in keys:
            self.hot_tier.remove(key)
        if self.store.readonly or not keys:
            return 0
        removed = 0

        def remove() -> None:
            nonlocal removed
            removed = self.store.batched_remove(keys)

        self._tolerate_write_failure(remove)
        return removed

    def publish(self, namespace: CacheNamespace, token_id_lists: Sequence[Sequence[int]]) -> int:
        """Upload to the remote tier the disk store's entries of these token sequences that the remote lacks (a
        precompute that finds them already on disk, made before a remote was configured or while it failed);
        the number handed to the remote tier. Entries that fail their crc32 here are left out. No remote tier,
        or a read-only cache: 0."""
        if self.remote is None or not self._remote_writable:
            return 0
        keys = list(dict.fromkeys(segment_key(namespace, ids) for ids in token_id_lists))
        local = [key for key, held in zip(keys, self.store.batched_contains(keys)) if held]
        absent = [key for key, held in zip(local, self.remote.contains_many(local)) if not held]
        handed = 0
        for key in absent:
            value = self.store.get(key, touch=False)
            if value is None:
                continue
            try:
                read_header(value)  # the crc32 and the layout: never upload damaged bytes
            except (CorruptEntryError, IncompatibleEntryError) as error:
                log.warning("cache entry %s in %s not published (%s)", key_label(key), self.store.path, error)
                continue
            handed += self.remote.put_many([(key, value)])
        return handed

    def flush_remote(self, timeout_s: float | None = None) -> bool:
        """Wait for the remote tier's queued uploads (True when none is left, or there is no remote tier)."""
        return True if self.remote is None else self.remote.flush(timeout_s)

    def close(self) -> None:
        """Write pending access notes and close the store, then the remote tier (which waits a bounded time for
        its queued uploads; idempotent)."""
        self.hot_tier.clear()
        try:
            self.store.close()
        finally:
            if self.remote is not None:
                self.remote.close()

    def __enter__(self) -> SegmentCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def stored_value(
    namespace: CacheNamespace, token_ids: Sequence[int], entry: Mapping[str, torch.Tensor]
) -> tuple[bytes, Entry, bytearray]:
    """(key, the entry as stored: in the namespace's cache format, its encoded value) of a freshly encoded
    `entry` of `token_ids`: the bytes every tier holds for it, whichever process computes them (a cache's put, a
    Ray actor uploading straight to the remote tier). ValueError when the entry's token_ids are not `token_ids`."""
    if TOKEN_IDS not in entry or not _same_token_ids(entry, token_ids):
        raise ValueError("an encoded entry's token_ids differ from the chunk it was computed for")
    stored_form = namespace.storage_format.compress(entry)
    return segment_key(namespace, token_ids), stored_form, encode_entry(stored_form, namespace.canonical())


def _same_token_ids(entry: Mapping[str, torch.Tensor], token_ids: Sequence[int]) -> bool:
    stored = entry.get(TOKEN_IDS)
    if stored is None or stored.dtype != torch.int64 or stored.dim() != 1 or stored.numel() != len(token_ids):
        return False
    return stored.tolist() == list(token_ids)  # a list compare: no tensor made per lookup
