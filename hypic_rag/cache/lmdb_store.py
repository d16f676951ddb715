"""`SegmentStore` on an LMDB environment: many reader processes, one writer at a time, durable commits.

- Concurrency: LMDB's lock file serialises writers across processes and gives every reader a consistent snapshot,
  so a reader always sees whole values (a value is copied out of its read transaction once, into a bytearray).
  Every process, reader or writer, opens with ``lock=True``. Within a process one `threading.RLock` serialises
  the use of the environment (map resizing requires that no transaction of this process is open).
- Durability: ``sync=True`` and ``metasync=True`` (fsync on every commit), no ``writemap`` (a crashing process
  cannot scribble on the map). A killed writer leaves its transaction uncommitted: nothing of it is visible.
- Budget: the stored value bytes are kept under ``budget_bytes`` by evicting the least recently used entries in
  the same transaction as the put. The LMDB map (virtual address space; the file only grows as pages are used)
  starts small and doubles on ``MapFullError`` up to ``max_map_bytes`` (2 x budget + 64 MiB by default, room for
  copy-on-write pages held by old readers); past that the put evicts a quarter of what is stored and retries,
  and as a last resort grows past the cap with a warning. A value larger than the whole budget is skipped
  (logged, counted), never an exception.
- Damage: a data file shorter than its meta pages say (a cut or truncated copy) would make LMDB touch pages past
  the end of the file, which kills the process with SIGBUS. `open` reads the two meta pages first and refuses
  such a file with `CacheDamagedError`; `discard_damaged_store` removes it (``hypic-rag cache clear``).
- Failed writes (disk full, I/O error) raise `CacheWriteError`; LMDB rolls the transaction back, so what was
  stored before stays intact and readable.
- LRU: reads note their access time in memory; the notes are written with the next write transaction, after
  `TOUCH_FLUSH_COUNT` notes or `TOUCH_FLUSH_SECONDS`, and on close (a crash loses only recency hints).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any, TypeVar

import lmdb

from hypic_rag.cache.errors import CacheDamagedError, CacheError, CacheOpenError, CacheWriteError, free_space_note
from hypic_rag.cache.lmdb_records import (
    BUDGET_KEY,
    SCHEMA,
    SCHEMA_KEY,
    SUB_DATABASES,
    EntryRecord,
    entry_key_of_lru_key,
    lru_key,
    pack_u64,
    read_counters,
    unpack_u64,
    write_counters,
)
from hypic_rag.cache.store import PutRequest, SegmentStore, StoreCounters

log = logging.getLogger(__name__)

MIB = 1 << 20
GIB = 1 << 30
DEFAULT_BUDGET_BYTES = 32 * GIB
MAP_HEADROOM_BYTES = 64 * MIB
INITIAL_MAP_BYTES = GIB  # address space only: the file grows as pages are used
TOUCH_FLUSH_SECONDS = 2.0
TOUCH_FLUSH_COUNT = 512
MAX_READERS = 256
MAX_WRITE_ATTEMPTS = 24

_T = TypeVar("_T")
_LMDB_MAGIC = (0xBEEFC0DE).to_bytes(4, "little")
_LMDB_MAGIC_OFFSET = 16  # after the 16-byte page header of meta page 0
# An LMDB 0.9 meta page on a 64-bit build: page header (16 bytes), then MDB_meta: magic, data version, fixed map
# address, map size, the free DB's record (its first field holds the page size) and the main DB's record (48 bytes
# each), last used page number, transaction id.
_LMDB_META = struct.Struct("<16xIIQQI92xQQ")
_LMDB_DATA_VERSION = 1
_LMDB_PAGE_SIZES = tuple(1 << shift for shift in range(9, 17))  # 512 .. 64 KiB


@dataclass(slots=True)
class _PendingLookups:
    """Access notes and lookup outcomes of this process not yet written to the store."""

    touches: dict[bytes, int] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    mismatched: int = 0
    since: float = field(default_factory=time.monotonic)

    def is_empty(self) -> bool:
        return not (self.touches or self.hits or self.misses or self.corrupt or self.mismatched)


def _check_directory(path: Path, *, readonly: bool, create: bool) -> None:
    """Refuse paths that are not (and cannot become) a segment cache, with a one-line reason."""
    if path.exists() and not path.is_dir():
        raise CacheOpenError(f"{path} is not a directory (a cache is a directory holding data.mdb)")
    data_file = path / "data.mdb"
    if not path.exists():
        if readonly or not create:
            raise CacheOpenError(f"no cache directory at {path}")
        try:
            path.mkdir(parents=True, exist_ok=True)  # another process may create it at the same moment
        except OSError as error:
            raise CacheOpenError(f"cannot create cache directory {path}: {error.strerror}") from None
        return
    if not data_file.exists():
        if readonly or not create:
            raise CacheOpenError(f"{path} holds no cache (no data.mdb)")
        if any(child.name not in ("lock.mdb", "data.mdb") for child in path.iterdir()):  # data.mdb: being created
            raise CacheOpenError(f"{path} is not empty and holds no cache; choose an empty or new directory")
    elif not data_file.is_file():
        raise CacheOpenError(f"{data_file} is not a file")
    elif not _has_lmdb_magic(data_file):
        raise CacheOpenError(f"{data_file} is not an LMDB store")
    elif readonly and data_file.stat().st_size == 0:  # created, never initialised: a write open initialises it
        raise CacheOpenError(f"{data_file} is empty: no cache was ever written there")
    else:
        problem = data_file_problem(data_file)
        if problem is not None:
            raise CacheDamagedError(
                f"{data_file} {problem}; `hypic-rag cache clear --cache {path}` replaces it with an empty cache"
            )


def _has_lmdb_magic(data_file: Path) -> bool:
    """True if the first meta page carries LMDB's magic (checked before LMDB writes a lock file beside it)."""
    try:
        with data_file.open("rb") as handle:
            head = handle.read(_LMDB_MAGIC_OFFSET + 4)
    except OSError as error:
        raise CacheOpenError(f"cannot read {data_file}: {error.strerror}") from None
    return len(head) == 0 or head[_LMDB_MAGIC_OFFSET:] == _LMDB_MAGIC


def data_file_problem(data_file: Path) -> str | None:
    """Why LMDB cannot safely map `data_file` (e.g. 'is truncated: ...'), or None when it can (or when it is
    empty, another LMDB version, or not LMDB at all: LMDB itself refuses those cleanly).

    LMDB writes whole pages, so a size that is not a whole number of pages, or less than the two meta pages, is a
    cut file. A file shorter than the newest meta page's last page number is not damaged by itself: pages allocated
    and freed inside one transaction are never written. So in that case the B-trees are walked (branch and leaf
    pages, and the first page of every large value, read with plain file reads, never mapped): the file is
    truncated only if a page the data reaches lies beyond its end. The walk is repeated if a writer commits
    meanwhile; with a writer that keeps committing, the file is left to LMDB (it is being written, not cut).
    """
    try:
        with data_file.open("rb") as handle:
            for _ in range(3):
                state = _read_meta_pages(handle)
                if isinstance(state, str) or state is None:
                    return state
                page_size, last_page, txnid, roots, size = state
                if size % page_size:
                    return f"is truncated: {size} bytes, not a whole number of {page_size}-byte pages"
                if size >= (last_page + 1) * page_size:
                    return None
                missing = _first_missing_page(handle, page_size, size // page_size, roots)
                again = _read_meta_pages(handle)
                if not isinstance(again, tuple) or again[2] == txnid:
                    if missing is None:
                        return None
                    return (f"is truncated: {size} bytes, but its data reaches page {missing} "
                            f"(pages of {page_size} bytes)")
    except OSError as error:
        raise CacheOpenError(f"cannot read {data_file}: {error.strerror}") from None
    return None


_LMDB_PAGE_HEADER = struct.Struct("<QHHHH")  # page number, pad, flags, lower, upper (or the overflow page count)
_LMDB_BRANCH, _LMDB_LEAF, _LMDB_OVERFLOW = 0x01, 0x02, 0x04
_LMDB_BIG_DATA, _LMDB_SUB_DATABASE = 0x01, 0x02
_LMDB_NO_PAGE = 0xFFFFFFFFFFFFFFFF
_LMDB_ROOT_OFFSET = 40  # of md_root inside an MDB_db record
_LMDB_DB_RECORD = 48


def _read_meta_pages(handle: IO[bytes]) -> tuple[int, int, int, list[int], int] | str | None:
    """(page size, last page, txn id, [free DB root, main DB root], file size) of the newer meta page; a reason
    string when the meta pages themselves are cut or damaged; None when this is not an LMDB file we know."""
    handle.seek(0)
    first = handle.read(_LMDB_META.size)
    if not first or first[_LMDB_MAGIC_OFFSET:_LMDB_MAGIC_OFFSET + 4] != _LMDB_MAGIC:
        return None
    if len(first) < _LMDB_META.size:
        return f"is truncated: {len(first)} bytes, less than its first LMDB meta page"
    magic, version, _, _, page_size, last_page, txnid = _LMDB_META.unpack(first)
    if version != _LMDB_DATA_VERSION:
        return None
    if page_size not in _LMDB_PAGE_SIZES:
        return f"is damaged: its first LMDB meta page records a page size of {page_size} bytes"
    newest = first
    handle.seek(page_size)
    second = handle.read(_LMDB_META.size)
    size = os.fstat(handle.fileno()).st_size
    if len(second) < _LMDB_META.size or size < 2 * page_size:
        return f"is truncated: {size} bytes, less than its two LMDB meta pages ({2 * page_size} bytes)"
    magic2, version2, _, _, page_size2, last_page2, txnid2 = _LMDB_META.unpack(second)
    if (magic2, version2, page_size2) != (magic, version, page_size):
        return "is damaged: its second LMDB meta page does not match the first"
    if txnid2 > txnid:
        newest, last_page, txnid = second, last_page2, txnid2
    databases = 16 + 24  # page header, then magic, version, address and map size
    roots = [
        struct.unpack_from("<Q", newest, databases + index * _LMDB_DB_RECORD + _LMDB_ROOT_OFFSET)[0]
        for index in (0, 1)
    ]
    return page_size, last_page, txnid, roots, size


def _first_missing_page(handle: IO[bytes], page_size: int, file_pages: int, roots: list[int]) -> int | None:
    """The first page reachable from `roots` (B-tree pages, sub-databases, large values) at or past `file_pages`."""
    pending = [root for root in roots if root != _LMDB_NO_PAGE]
    seen: set[int] = set()
    while pending:
        page_number = pending.pop()
        if page_number in seen:
            continue
        seen.add(page_number)
        if page_number >= file_pages:
            return page_number
        handle.seek(page_number * page_size)
        page = handle.read(page_size)
        _, _, flags, lower, _ = _LMDB_PAGE_HEADER.unpack_from(page)
        if not flags & (_LMDB_BRANCH | _LMDB_LEAF):
            continue
        for slot in range((lower - _LMDB_PAGE_HEADER.size) // 2):
            (offset,) = struct.unpack_from("<H", page, _LMDB_PAGE_HEADER.size + 2 * slot)
            low, high, node_flags, key_size = struct.unpack_from("<HHHH", page, offset)
            if flags & _LMDB_BRANCH:
                pending.append(low | high << 16 | node_flags << 32)
            elif node_flags & _LMDB_BIG_DATA:
                (first_page,) = struct.unpack_from("<Q", page, offset + 8 + key_size)
                if first_page >= file_pages:
                    return first_page
                handle.seek(first_page * page_size)
                _, _, _, count_low, count_high = _LMDB_PAGE_HEADER.unpack(handle.read(_LMDB_PAGE_HEADER.size))
                end = first_page + (count_low | count_high << 16)
                if end > file_pages:
                    return file_pages
            elif node_flags & _LMDB_SUB_DATABASE:
                (root,) = struct.unpack_from("<Q", page, offset + 8 + key_size + _LMDB_ROOT_OFFSET)
                if root != _LMDB_NO_PAGE:
                    pending.append(root)
    return None


def discard_damaged_store(directory: str | os.PathLike[str]) -> int:
    """Delete the data and lock files of a store that `open` refuses with `CacheDamagedError`; returns the size of
    the data file removed. Refused (`CacheOpenError`) when the store is not damaged, or while another process has
    it open (every LMDB process holds a shared lock on the first byte of lock.mdb).
    """
    path = Path(directory)
    data_file, lock_file = path / "data.mdb", path / "lock.mdb"
    try:
        _check_directory(path, readonly=True, create=False)
    except CacheDamagedError:
        pass
    else:
        raise CacheOpenError(f"{data_file} is not damaged; nothing to discard")
    lock_fd: int | None = None
    try:
        if lock_file.exists():
            lock_fd = os.open(lock_file, os.O_RDWR)
            try:
                fcntl.lockf(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
            except OSError:
                raise CacheOpenError(f"{path} is open in another process; stop it, then clear the cache") from None
        size = data_file.stat().st_size
        data_file.unlink()
        lock_file.unlink(missing_ok=True)
    except OSError as error:
        raise CacheOpenError(f"cannot remove the damaged store in {path}: {error.strerror}") from None
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
    log.info("removed the damaged cache store %s (%d bytes)", data_file, size)
    return size


def _open_environment(path: Path, *, readonly: bool, map_size: int) -> lmdb.Environment:
    options: dict[str, Any] = dict(
        subdir=True, readonly=readonly, max_dbs=len(SUB_DATABASES) + 2, max_readers=MAX_READERS,
        sync=True, metasync=True, writemap=False, lock=True, create=not readonly,
    )
    if not readonly:
        options["map_size"] = map_size
    try:
        return lmdb.open(str(path), **options)
    except lmdb.Error as error:
        reason = _lmdb_reason(error)
        if readonly and _is_permission_error(error):
            # A read-only medium: no lock file can be written, so no writer can be running either.
            log.info("opening %s without the reader lock (cannot write its lock file: %s)", path, reason)
            options["lock"] = False
            try:
                return lmdb.open(str(path), **options)
            except lmdb.Error as second_error:
                raise CacheOpenError(f"cannot open {path}: {_lmdb_reason(second_error)}") from None
        if _is_permission_error(error):
            raise CacheOpenError(f"cannot write to {path}: {reason.rsplit(': ', 1)[-1].lower()}"
                                 " (a read-only directory or file? it can still be opened read-only)") from None
        if isinstance(error, lmdb.InvalidError):
            raise CacheOpenError(f"{path / 'data.mdb'} is not an LMDB store") from None
        if "already open" in reason:
            raise CacheOpenError(f"{path} is already open in this process; share the open cache") from None
        raise CacheOpenError(f"cannot open {path} as an LMDB store: {reason}") from None


def _lmdb_reason(error: lmdb.Error) -> str:
    return str(error.args[-1]) if error.args else type(error).__name__


def _is_permission_error(error: lmdb.Error) -> bool:
    reason = _lmdb_reason(error).lower()
    return "permission denied" in reason or "read-only file system" in reason or getattr(
        error, "errno", None
    ) in (errno.EACCES, errno.EROFS, errno.EPERM)


class LmdbSegmentStore(SegmentStore):
    """An LMDB environment in `path` (data.mdb, lock.mdb) holding encoded segment entries. Use `open`."""

    def __init__(
        self, env: lmdb.Environment, databases: dict[bytes, Any], *, path: Path, budget_bytes: int, max_map_bytes: int,
        readonly: bool,
    ) -> None:
        self.path = path
        self.readonly = readonly
        self.budget_bytes = budget_bytes
        self.max_map_bytes = max_map_bytes
        self._env: lmdb.Environment | None = env
        self._entries = databases[b"entries"]
        self._records = databases[b"records"]
        self._lru = databases[b"lru"]
        self._meta = databases[b"meta"]
        self._lock = threading.RLock()
        self._pending = _PendingLookups()

    # ----------------------------------------------------------------------------------------------- opening
    @classmethod
    def open(
        cls, directory: str | os.PathLike[str], *, budget_bytes: int | None = None, readonly: bool = False,
        create: bool = True, initial_map_bytes: int | None = None, max_map_bytes: int | None = None,
    ) -> LmdbSegmentStore:
        """Open (or create, unless `readonly` or not `create`) the store in `directory`.

        budget_bytes: cap on stored value bytes (None: the budget recorded in the store, else 32 GiB); recorded
        for later opens and the CLI. Raises CacheOpenError with a one-line reason for any unusable directory.
        """
        path = Path(directory)
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        _check_directory(path, readonly=readonly, create=create)
        planned_cap = max_map_bytes or 2 * (budget_bytes or DEFAULT_BUDGET_BYTES) + MAP_HEADROOM_BYTES
        map_size = initial_map_bytes or min(planned_cap, INITIAL_MAP_BYTES)
        env = _open_environment(path, readonly=readonly, map_size=map_size)
        try:
            databases = _open_sub_databases(env, path, readonly=readonly)
            with env.begin(db=databases[b"meta"]) as txn:
                stored_budget = unpack_u64(txn.get(BUDGET_KEY))
            budget = budget_bytes or stored_budget or DEFAULT_BUDGET_BYTES
            store = cls(
                env, databases, path=path, budget_bytes=budget,
                max_map_bytes=max_map_bytes or 2 * budget + MAP_HEADROOM_BYTES, readonly=readonly,
            )
            if not readonly:
                dead_readers = env.reader_check()
                if dead_readers:
                    log.info("cleared %d reader slots of dead processes in %s", dead_readers, path)
                if budget != stored_budget:
                    store.set_budget(budget, max_map_bytes=max_map_bytes)
                if store.counters().value_bytes > budget:
                    store.evict_to(budget)
            return store
        except BaseException:
            env.close()
            raise

    # ------------------------------------------------------------------------------------------ reading
    def contains(self, key: bytes) -> bool:
        return self.batched_contains([key])[0]

    def batched_contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock, self._begin(buffers=True) as txn:
            return [txn.get(key, db=self._entries) is not None for key in keys]

    def get(self, key: bytes, *, touch: bool = True) -> bytearray | None:
        return self.batched_get([key], touch=touch)[0]

    def batched_get(self, keys: Sequence[bytes], *, touch: bool = True) -> list[bytearray | None]:
        """Copy each value out of one read snapshot (one memcpy per value; the snapshot ends before return)."""
        with self._lock:
            with self._begin(buffers=True) as txn:
                values: list[bytearray | None] = []
                for key in keys:
                    view = txn.get(key, db=self._entries)
                    values.append(None if view is None else bytearray(view))
            if touch:
                self.touch([key for key, value in zip(keys, values) if value is not None])
        return values

    def touch(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            now = time.time_ns()
            for key in keys:
                self._pending.touches[bytes(key)] = now
            self._maybe_flush()

    def keys(self) -> Iterator[bytes]:
        with self._lock, self._begin() as txn:
            snapshot = list(txn.cursor(db=self._entries).iternext(keys=True, values=False))
        return iter(snapshot)

    def record(self, key: bytes) -> EntryRecord | None:
        """The bookkeeping record (last access, sizes) of `key`, as last written."""
        with self._lock, self._begin() as txn:
            raw = txn.get(key, db=self._records)
        return None if raw is None else EntryRecord.unpack(raw)

    def value_bytes(self, key: bytes) -> int | None:
        """From the entry's record: the value itself is not read."""
        record = self.record(key)
        return None if record is None else record.value_bytes

    def lru_order(self) -> list[bytes]:
        """Every key, least recently used first (as last written)."""
        with self._lock, self._begin() as txn:
            return [entry_key_of_lru_key(k) for k in txn.cursor(db=self._lru).iternext(keys=True, values=False)]

    def counters(self) -> StoreCounters:
        with self._lock:
            with self._begin() as txn:
                counters = read_counters(txn, self._meta)
            pending = self._pending
            counters.hits += pending.hits
            counters.misses += pending.misses
            counters.corrupt += pending.corrupt
            counters.mismatched += pending.mismatched
        return counters

    def info(self) -> dict[str, int | str | bool]:
        """Environment facts: map size, file size, page size, readers, budget."""
        env = self._require_open()
        with self._lock:
            env_info = env.info()
            env_stat = env.stat()
        data_file = self.path / "data.mdb"
        return {
            "path": str(self.path),
            "readonly": self.readonly,
            "budget_bytes": self.budget_bytes,
            "map_bytes": int(env_info["map_size"]),
            "max_map_bytes": self.max_map_bytes,
            "file_bytes": data_file.stat().st_size if data_file.exists() else 0,
            "used_bytes": (int(env_info["last_pgno"]) + 1) * int(env_stat["psize"]),
            "readers": int(env_info["num_readers"]),
        }

    # ------------------------------------------------------------------------------------------ writing
    def put(self, request: PutRequest) -> bool:
        return self.batched_put([request])[0]

    def batched_put(self, requests: Iterable[PutRequest]) -> list[bool]:
        """Store every request in one transaction (all or none are visible), evicting LRU entries to fit."""
        source = iter(requests)
        consumed: list[PutRequest] = []

        def replayable() -> Iterator[PutRequest]:  # a retry after growing the map replays what was read
            yield from list(consumed)
            for request in source:
                consumed.append(request)
                yield request

        def body(txn: lmdb.Transaction, counters: StoreCounters) -> list[bool]:
            return [self._put_in(txn, counters, request) for request in replayable()]

        def give_up() -> list[bool]:
            consumed.extend(source)
            return [False] * len(consumed)

        return self._write(body, on_give_up=give_up)

    def remove(self, key: bytes) -> bool:
        return self.batched_remove([key]) == 1

    def batched_remove(self, keys: Sequence[bytes]) -> int:
        return self._write(lambda txn, counters: sum(self._delete_in(txn, counters, key) for key in keys))

    def record_lookups(self, *, hits: int = 0, misses: int = 0, corrupt: int = 0, mismatched: int = 0) -> None:
        with self._lock:
            self._pending.hits += hits
            self._pending.misses += misses
            self._pending.corrupt += corrupt
            self._pending.mismatched += mismatched
            self._maybe_flush()

    def flush(self) -> None:
        """Write pending access notes and lookup counts now (no-op when read-only or nothing is pending)."""
        with self._lock:
            if not self.readonly and not self._pending.is_empty():
                self._write(lambda txn, counters: None)

    def set_budget(self, budget_bytes: int, *, max_map_bytes: int | None = None) -> None:
        """Record a new byte budget for this and later opens (eviction happens on the next put or `evict_to`)."""
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        self._write(lambda txn, counters: txn.put(BUDGET_KEY, pack_u64(budget_bytes), db=self._meta))
        self.budget_bytes = budget_bytes
        self.max_map_bytes = max_map_bytes or 2 * budget_bytes + MAP_HEADROOM_BYTES

    def evict_to(self, budget_bytes: int) -> int:
        return self._write(lambda txn, counters: self._evict_in(txn, counters, budget_bytes))

    def clear(self) -> int:
        def body(txn: lmdb.Transaction, counters: StoreCounters) -> int:
            removed = counters.entries
            for database in (self._entries, self._records, self._lru):
                txn.drop(database, delete=False)
            counters.entries = counters.value_bytes = counters.linear_bytes = counters.kv_bytes = 0
            return removed

        with self._lock:
            self._pending.touches.clear()
            return self._write(body)

    def close(self) -> None:
        with self._lock:
            if self._env is None:
                return
            if not self.readonly and not self._pending.is_empty():
                try:
                    self.flush()
                except (lmdb.Error, CacheError) as error:
                    log.warning("could not write access notes of %s on close: %s", self.path, error)
            self._env.close()
            self._env = None

    def __enter__(self) -> LmdbSegmentStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ internals
    def _require_open(self) -> lmdb.Environment:
        if self._env is None:
            raise CacheError(f"the cache at {self.path} is closed")
        return self._env

    def _begin(self, *, write: bool = False, buffers: bool = False) -> lmdb.Transaction:
        env = self._require_open()
        try:
            return env.begin(write=write, buffers=buffers)
        except lmdb.MapResizedError:  # another process grew the map: adopt its size
            env.set_mapsize(0)
            return env.begin(write=write, buffers=buffers)

    def _write(
        self, body: Callable[[lmdb.Transaction, StoreCounters], _T], on_give_up: Callable[[], _T] | None = None,
    ) -> _T:
        """Run `body` in one write transaction that also writes pending notes and the counters.

        On MapFullError the transaction is rolled back, room is made (`_make_room`) and `body` runs again.
        """
        if self.readonly:
            raise CacheError(f"the cache at {self.path} is open read-only")
        with self._lock:
            for attempt in range(MAX_WRITE_ATTEMPTS):
                pending, self._pending = self._pending, _PendingLookups()
                try:
                    with self._begin(write=True) as txn:
                        counters = read_counters(txn, self._meta)
                        self._apply_pending(txn, counters, pending)
                        result = body(txn, counters)
                        write_counters(txn, self._meta, counters)
                    return result
                except lmdb.MapFullError:
                    self._restore_pending(pending)
                    self._make_room(attempt)
                except lmdb.Error as error:  # disk full, I/O error: LMDB rolled the transaction back
                    self._restore_pending(pending)
                    raise CacheWriteError(
                        f"cannot write to the cache at {self.path}: {error}{free_space_note(self.path)}"
                        "; the entries stored before are intact"
                    ) from None
                except BaseException:
                    self._restore_pending(pending)
                    raise
            if on_give_up is None:
                raise CacheError(f"the cache at {self.path} stays full after {MAX_WRITE_ATTEMPTS} attempts")
            log.error("cache %s stays full after %d attempts; the put is skipped", self.path, MAX_WRITE_ATTEMPTS)
            return on_give_up()

    def _restore_pending(self, pending: _PendingLookups) -> None:
        """Merge notes taken out for a transaction that did not commit back into the pending ones."""
        newer = self._pending
        pending.touches.update(newer.touches)
        pending.hits += newer.hits
        pending.misses += newer.misses
        pending.corrupt += newer.corrupt
        pending.mismatched += newer.mismatched
        self._pending = pending

    def _make_room(self, attempt: int) -> None:
        """After MapFullError: double the map up to the cap; at the cap evict a quarter of the stored bytes
        (least recently used first); if that keeps failing, grow past the cap in headroom steps (logged)."""
        env = self._require_open()
        map_bytes = int(env.info()["map_size"])
        if map_bytes < self.max_map_bytes:
            new_size = min(self.max_map_bytes, 2 * map_bytes)
            log.info("cache %s: growing the LMDB map from %d to %d bytes", self.path, map_bytes, new_size)
            env.set_mapsize(new_size)
            return
        counters = self.counters()
        if counters.entries and attempt < MAX_WRITE_ATTEMPTS // 2:
            target = min(counters.value_bytes, self.budget_bytes) * 3 // 4
            log.info("cache %s: map full at its cap; evicting down to %d bytes", self.path, target)
            try:
                self.evict_to(target)
                return
            except lmdb.MapFullError:
                pass
        new_size = map_bytes + MAP_HEADROOM_BYTES
        log.warning("cache %s: map full at %d bytes; growing past the cap to %d", self.path, map_bytes, new_size)
        env.set_mapsize(new_size)

    def _apply_pending(self, txn: lmdb.Transaction, counters: StoreCounters, pending: _PendingLookups) -> None:
        counters.hits += pending.hits
        counters.misses += pending.misses
        counters.corrupt += pending.corrupt
        counters.mismatched += pending.mismatched
        for key, access_ns in pending.touches.items():
            raw = txn.get(key, db=self._records)
            if raw is None:
                continue  # removed or evicted since it was read
            record = EntryRecord.unpack(raw)
            if access_ns <= record.last_access_ns:
                continue
            txn.delete(lru_key(record.last_access_ns, key), db=self._lru)
            txn.put(lru_key(access_ns, key), b"", db=self._lru)
            txn.put(key, replace(record, last_access_ns=access_ns).pack(), db=self._records)

    def _maybe_flush(self) -> None:
        pending = self._pending
        if self.readonly or pending.is_empty():
            return
        if len(pending.touches) >= TOUCH_FLUSH_COUNT or time.monotonic() - pending.since >= TOUCH_FLUSH_SECONDS:
            try:
                self.flush()
            except CacheWriteError as error:  # notes and counters are hints: keep them, try again later
                self._pending.since = time.monotonic()
                log.warning("%s (access notes kept in memory)", error)

    def _put_in(self, txn: lmdb.Transaction, counters: StoreCounters, request: PutRequest) -> bool:
        key, size = bytes(request.key), len(request.value)
        if size > self.budget_bytes:
            counters.skipped_puts += 1
            log.warning("cache %s: entry of %d bytes exceeds the whole budget (%d); not stored",
                        self.path, size, self.budget_bytes)
            return False
        self._delete_in(txn, counters, key)
        self._evict_in(txn, counters, self.budget_bytes - size)
        now = time.time_ns()
        txn.put(key, request.value, db=self._entries)
        txn.put(key, EntryRecord(now, size, request.linear_bytes, request.kv_bytes).pack(), db=self._records)
        txn.put(lru_key(now, key), b"", db=self._lru)
        counters.entries += 1
        counters.value_bytes += size
        counters.linear_bytes += request.linear_bytes
        counters.kv_bytes += request.kv_bytes
        return True

    def _delete_in(self, txn: lmdb.Transaction, counters: StoreCounters, key: bytes) -> bool:
        raw = txn.get(key, db=self._records)
        if raw is not None:
            record = EntryRecord.unpack(raw)
            txn.delete(key, db=self._records)
            txn.delete(lru_key(record.last_access_ns, key), db=self._lru)
        else:
            value = txn.get(key, db=self._entries)
            record = None if value is None else EntryRecord(0, len(value), 0, 0)
        if record is None or not txn.delete(key, db=self._entries):
            return False
        counters.entries = max(0, counters.entries - 1)
        counters.value_bytes = max(0, counters.value_bytes - record.value_bytes)
        counters.linear_bytes = max(0, counters.linear_bytes - record.linear_bytes)
        counters.kv_bytes = max(0, counters.kv_bytes - record.kv_bytes)
        return True

    def _evict_in(self, txn: lmdb.Transaction, counters: StoreCounters, budget_bytes: int) -> int:
        evicted = 0
        cursor = txn.cursor(db=self._lru)
        while counters.value_bytes > budget_bytes and cursor.first():
            key = entry_key_of_lru_key(cursor.key())
            if not self._delete_in(txn, counters, key):
                cursor.delete()  # an index item without its entry: drop it
                continue
            evicted += 1
            counters.evictions += 1
        if counters.value_bytes > budget_bytes and not cursor.first():
            log.warning("cache %s: byte counters disagree with the LRU index; resetting them", self.path)
            counters.value_bytes = counters.linear_bytes = counters.kv_bytes = counters.entries = 0
        if evicted:
            log.info("cache %s: evicted %d least recently used entries", self.path, evicted)
        return evicted


def _open_sub_databases(env: lmdb.Environment, path: Path, *, readonly: bool) -> dict[bytes, Any]:
    """Open the store's sub-databases, creating them in a new environment; refuse foreign LMDB stores."""
    with env.begin() as txn:
        names = set(txn.cursor().iternext(keys=True, values=False))
    if not names:
        if readonly:
            raise CacheOpenError(f"{path} is an empty LMDB store, not a hypic-rag cache")
        # one write transaction: another process opening the store meanwhile (the workers of `serve` start
        # together) sees either no sub-database or all of them with the schema, never a part
        with env.begin(write=True) as txn:
            databases = {name: env.open_db(name, txn=txn, create=True) for name in SUB_DATABASES}
            txn.put(SCHEMA_KEY, SCHEMA, db=databases[b"meta"])
        return databases
    if b"meta" not in names:
        raise CacheOpenError(f"{path} is an LMDB store but not a hypic-rag cache")
    try:
        databases = {name: env.open_db(name, create=False) for name in SUB_DATABASES}
    except lmdb.Error:
        raise CacheOpenError(f"{path} is an LMDB store but not a hypic-rag cache (missing sub-databases)") from None
    with env.begin(db=databases[b"meta"]) as txn:
        schema = txn.get(SCHEMA_KEY)
    if schema != SCHEMA:
        raise CacheOpenError(f"{path} is an LMDB store with schema {schema!r}, expected {SCHEMA!r}")
    return databases
