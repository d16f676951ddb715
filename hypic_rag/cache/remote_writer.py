"""The remote tier's write-behind queue: uploads run on background threads, bounded by bytes.

Why write-behind rather than uploading inside the request: an entry is ~100 MB at full scale, so an upload is
0.1-1 s on a fast link and much more on a slow one, and it buys nothing for the request that encoded the entry
(it already holds it, and the local tiers have it). Only other hosts gain, later. A bounded queue keeps that
work off the request path while capping the memory it holds (the queued values are the encoded bytes already
made for the local store, not copies). When the queue is full a put is dropped (ask, serve: another host will
encode and upload the entry, or this one on its next miss), or waits for room (`wait_when_full`, precompute,
whose job is to fill the tier). `flush` waits until the queue is empty; `close` flushes with a deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from hypic_rag.cache.keys import key_label

log = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class UploadJob:
    """One value to upload under `key`; overwrite: upload even if an object with the same checksum is there."""

    key: bytes
    value: Buffer
    overwrite: bool = False


class WriteBehindQueue:
    """FIFO of `UploadJob`s run by `workers` daemon threads calling `upload(job)` (which must not raise).

    max_bytes: queued value bytes (a value larger than this is accepted when the queue is empty); wait_when_full:
    `submit` blocks for room instead of dropping. Thread-safe.
    """

    def __init__(
        self, upload: Callable[[UploadJob], object], *, max_bytes: int, wait_when_full: bool, workers: int, name: str,
    ) -> None:
        self._upload = upload
        self.max_bytes = max_bytes
        self.wait_when_full = wait_when_full
        self.name = name
        self._jobs: deque[UploadJob] = deque()
        self._queued_keys: set[bytes] = set()
        self._condition = threading.Condition()
        self._bytes = 0
        self._in_flight = 0
        self._closing = False
        self.dropped = 0
        self._threads = [
            threading.Thread(target=self._run, name=f"hypic-remote-writer-{index}", daemon=True)
            for index in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def pending_entries(self) -> int:
        """Jobs queued or being uploaded."""
        return len(self._jobs) + self._in_flight

    @property
    def pending_bytes(self) -> int:
        """Value bytes of the jobs queued or being uploaded."""
        return self._bytes

    def submit(self, job: UploadJob) -> bool:
        """Queue `job`; False when it was dropped (the queue is full, or closed). A key already queued is not
        queued twice (True)."""
        size = len(job.value)
        with self._condition:
            if job.key in self._queued_keys:
                return True
            while not self._closing and self._bytes and self._bytes + size > self.max_bytes:
                if not self.wait_when_full:
                    self.dropped += 1
                    log.debug("remote cache %s: write queue full, entry %s not uploaded", self.name, key_label(job.key))
                    return False
                self._condition.wait()
            if self._closing:
                self.dropped += 1
                return False
            self._jobs.append(job)
            self._queued_keys.add(job.key)
            self._bytes += size
            self._condition.notify_all()
            return True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued job has been uploaded (or failed); False if `timeout_s` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._condition:
            while self._jobs or self._in_flight:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._condition.wait(remaining)
        return True

    def close(self, timeout_s: float | None) -> int:
        """Flush for at most `timeout_s`, then stop taking jobs; what is still queued is dropped (logged, and
        the number returned)."""
        drained = self.flush(timeout_s)
        with self._condition:
            self._closing = True
            left = len(self._jobs)
            self.dropped += left
            self._jobs.clear()
            self._queued_keys.clear()
            self._condition.notify_all()
        if not drained and left:
            log.warning("remote cache %s: %d queued uploads dropped at close (not finished within %s s)",
                        self.name, left, timeout_s)
        return left

    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._jobs and not self._closing:
                    self._condition.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._queued_keys.discard(job.key)
                self._in_flight += 1
            try:
                self._upload(job)
            except Exception:  # noqa: BLE001 - a writer thread must survive anything an upload raises
                log.exception("remote cache %s: upload of %s failed unexpectedly", self.name, key_label(job.key))
            finally:
                with self._condition:
                    self._in_flight -= 1
                    self._bytes -= len(job.value)
                    self._condition.notify_all()
