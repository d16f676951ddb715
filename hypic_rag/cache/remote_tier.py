"""The shared remote cache tier: encoded entries as objects in S3-compatible storage (boto3), below each host's
hot tier and LMDB store.

    tier = RemoteTier.from_url("s3://bucket/hypic", endpoint_url="http://127.0.0.1:9000")
    cache = SegmentCache.open(directory, namespace=namespace, remote=tier)   # hot -> LMDB -> remote -> encode

Objects: the key's two digests in hex, ``<prefix>/<namespace digest>/<token ids digest>`` (only [0-9a-f/], so any
store takes them; one namespace's entries share a prefix). An object holds exactly the bytes the local store
holds (the `codec` value, with its crc32), and its metadata the codec's crc32 (``x-amz-meta-hypic-crc32``), so an
upload can be skipped when the same value is already there. The caller (`SegmentCache`) verifies every fetched
value as it verifies a local one (crc32, length, namespace, token ids); a bad object is reported back with
`discard`, which deletes it and makes the next upload of that key overwrite whatever is there.

Failure model: nothing here raises for a remote that fails (connection refused, timeouts, 5xx, access denied,
missing bucket, no credentials). A failed lookup is a miss, a failed write is dropped, each counted; the first
failure logs one warning and marks the tier down (`remote_health.RemoteHealth`): no call goes out until a
background probe (one HEAD of the bucket, made once the cool-down is over, and again after each failed probe)
finds it answering. So a dead remote costs the one call that found it dead (short timeouts, bounded retries:
`RemoteTierConfig`), not one per request, and no request waits on the probes. Only a wrong configuration raises
(`RemoteTierConfigError`, when the tier is made).

A `RemoteTier` pickles as its configuration (a Ray task or actor rebuilds its own client and threads).
"""

from __future__ import annotations

import logging
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from hypic_rag.cache.errors import RemoteTierConfigError
from hypic_rag.cache.keys import split_key
from hypic_rag.cache.remote_config import RemoteTierConfig
from hypic_rag.cache.remote_health import RemoteHealth
from hypic_rag.cache.remote_writer import Buffer, UploadJob, WriteBehindQueue

log = logging.getLogger(__name__)

CRC_METADATA = "hypic-crc32"
"""Object metadata holding the codec's crc32 of the value (8 hex digits)."""
READ_CHUNK_BYTES = 1 << 20
WRITER_THREADS = 2
CLOSE_TIMEOUT_S = 60.0
"""How long `close` waits for queued uploads by default."""
UPLOADED = "uploaded"
PRESENT = "present"
"""`store_now` outcomes: the value was sent; the same value was already there."""

_T = TypeVar("_T")
_MISSING = object()  # a call answered "no such object"
_FAILED = object()  # a call failed (counted and reported) or was not tried (cooling down)


@dataclass(slots=True)
class RemoteCounters:
    """What this process's tier did (not persistent; `stats` reports them as ``remote_<name>``).

    lookups: values asked for; found / not_found: there / not there; skipped: calls not made (cooling down);
    errors: failed calls of any kind; corrupt: fetched values the caller found bad (`discard`); bytes_read: value bytes fetched.
    puts: values uploaded; puts_skipped: already there with the same checksum; puts_dropped: not uploaded (queue
    full, cooling down, closing); bytes_written: value bytes uploaded; deletes: bad objects deleted.
    """

    lookups: int = 0
    found: int = 0
    not_found: int = 0
    skipped: int = 0
    errors: int = 0
    corrupt: int = 0
    bytes_read: int = 0
    puts: int = 0
    puts_skipped: int = 0
    puts_dropped: int = 0
    bytes_written: int = 0
    deletes: int = 0


@dataclass(slots=True)
class RemoteInventory:
    """What a remote tier holds: objects, their bytes, and objects per namespace digest (hex)."""

    objects: int = 0
    bytes: int = 0
    per_namespace: dict[str, int] = field(default_factory=dict)


def value_crc32(value: Buffer) -> int | None:
    """The crc32 a codec value carries in its prelude (bytes 12..16), or None for a value too short to have one."""
    if len(value) < 16:
        return None
    return struct.unpack_from("<I", value, 12)[0]


def _client_modules() -> tuple[Any, Any, Any]:
    """(boto3, botocore.config.Config, botocore.exceptions), or `RemoteTierConfigError` when boto3 is missing."""
    try:
        import boto3
        from botocore import exceptions
        from botocore.config import Config
    except ImportError:
        raise RemoteTierConfigError(
            "the remote cache tier needs boto3, which is not installed: pip install 'hypic-rag[remote]'"
        ) from None
    return boto3, Config, exceptions


def check_client_installed() -> None:
    """Raise `RemoteTierConfigError` (bad input) when boto3 cannot be imported (cheap once imported)."""
    _client_modules()


class RemoteTier:
    """Byte values under segment keys in an S3 bucket, shared by every host and process that names it.

    Lookups (`contains_many`, `get_many`) run up to `config.max_concurrency` requests in parallel; writes
    (`put_many`) go through a bounded write-behind queue unless `config.write_behind` is False. Thread-safe.
    Close it (`close` waits for queued uploads, `CLOSE_TIMEOUT_S` by default).
    """

    def __init__(self, config: RemoteTierConfig) -> None:
        boto3, Config, exceptions = _client_modules()
        self.config = config
        self._client_errors: tuple[type[BaseException], ...] = (exceptions.BotoCoreError, OSError)
        try:
            from urllib3.exceptions import HTTPError as Urllib3Error

            self._client_errors += (Urllib3Error,)
        except ImportError:  # pragma: no cover - botocore depends on urllib3
            pass
        self._client_error_type = exceptions.ClientError
        client_config = Config(
            connect_timeout=config.connect_timeout_s,
            read_timeout=config.read_timeout_s,
            retries={"total_max_attempts": config.max_attempts, "mode": "standard"},
            max_pool_connections=config.max_concurrency + WRITER_THREADS + 2,
            response_checksum_validation="when_required",  # the codec's crc32 checks every value read
            s3={"addressing_style": "path" if config.endpoint_url else "auto"},
        )
        try:
            session = boto3.session.Session()  # a session of its own: sessions are not thread-safe, clients are
            self._client = session.client(
                "s3", endpoint_url=config.endpoint_url, region_name=config.region, config=client_config
            )
        except (exceptions.BotoCoreError, ValueError) as error:  # a bad region or AWS_ENDPOINT_URL, a broken profile
            raise RemoteTierConfigError(f"cannot set up the remote cache {config.url}: {error}") from None
        self.health = RemoteHealth(
            config.url, cooldown_s=config.cooldown_s, max_cooldown_s=config.max_cooldown_s,
            warn_interval_s=config.warn_interval_s,
        )
        self._counters = RemoteCounters()
        self._lock = threading.Lock()
        self._distrusted: set[bytes] = set()
        self._readers: ThreadPoolExecutor | None = None
        self._closed = False
        self._probing = False
        self._writer: WriteBehindQueue | None = None
        if config.write_behind and not config.read_only:
            self._writer = WriteBehindQueue(
                self._upload, max_bytes=config.queue_bytes, wait_when_full=config.wait_when_full,
                workers=WRITER_THREADS, name=config.url,
            )

    @classmethod
    def from_url(cls, url: str, *, endpoint_url: str | None = None, **options: Any) -> RemoteTier:
        """The tier at ``s3://bucket[/prefix]``; other `RemoteTierConfig` fields by name."""
        return cls(RemoteTierConfig.from_url(url, endpoint_url=endpoint_url, **options))

    def __reduce__(self) -> tuple[Callable[..., RemoteTier], tuple[RemoteTierConfig]]:
        return (type(self), (self.config,))

    def __repr__(self) -> str:
        return f"RemoteTier({self.config.url!r}, endpoint_url={self.config.endpoint_url!r})"

    @property
    def url(self) -> str:
        return self.config.url

    def object_name(self, key: bytes) -> str:
        """``<prefix>/<namespace digest hex>/<token ids digest hex>`` of a 48-byte segment key."""
        namespace, tokens = split_key(bytes(key))
        name = f"{namespace.hex()}/{tokens.hex()}"
        return f"{self.config.prefix}/{name}" if self.config.prefix else name

    # ------------------------------------------------------------------------------------------- reading
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether an object is stored under each key (HEAD requests; a failed or skipped one says False)."""
        return self._parallel(self._contains_one, list(keys))

    def get_many(self, keys: Sequence[bytes]) -> list[bytearray | None]:
        """The value stored under each key (a private bytearray), or None: not there, failed, or not asked."""
        return self._parallel(self._get_one, list(keys))

    def _contains_one(self, key: bytes) -> bool:
        result = self._call("looking up", lambda: self._client.head_object(
            Bucket=self.config.bucket, Key=self.object_name(key)))
        return result is not _FAILED and result is not _MISSING

    def _get_one(self, key: bytes) -> bytearray | None:
        with self._lock:
            self._counters.lookups += 1
        result = self._call("reading", lambda: self._read_object(self.object_name(key)))
        with self._lock:
            if result is _MISSING:
                self._counters.not_found += 1
            elif result is not _FAILED:
                self._counters.found += 1
                self._counters.bytes_read += len(result)
        return result if isinstance(result, bytearray) else None

    def _read_object(self, name: str) -> bytearray:
        """The object's bytes, read into one preallocated buffer; a short or long body is an error."""
        response = self._client.get_object(Bucket=self.config.bucket, Key=name)
        length = int(response["ContentLength"])
        value = bytearray(length)
        view = memoryview(value)
        position = 0
        body = response["Body"]
        try:
            for chunk in body.iter_chunks(READ_CHUNK_BYTES):
                end = position + len(chunk)
                if end > length:
                    raise OSError(f"object {name} sent more than its {length} bytes")
                view[position:end] = chunk
                position = end
        finally:
            body.close()
        if position != length:
            raise OSError(f"object {name} ended after {position} of {length} bytes")
        return value

    # ------------------------------------------------------------------------------------------- writing
    def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> int:
        """Store each (key, value): queued for upload (write-behind) or uploaded now; the number accepted (the rest
        were dropped: read-only tier, queue full, closed). Idempotent: a value already stored under its key with
        the same crc32 and length is not uploaded again. Values must not change after this call."""
        if self.config.read_only or not items:
            return 0
        if self._closed:
            with self._lock:
                self._counters.puts_dropped += len(items)
            return 0
        accepted = 0
        for key, value in items:
            job = UploadJob(bytes(key), value, overwrite=bytes(key) in self._distrusted)
            if self._writer is None:
                self._upload(job)
                accepted += 1
            elif self._writer.submit(job):
                accepted += 1
        dropped = len(items) - accepted
        if dropped:
            with self._lock:
                self._counters.puts_dropped += dropped
        return accepted

    def discard(self, keys: Sequence[bytes], *, corrupt: bool = True) -> None:
        """Objects under `keys` were fetched and found bad (`corrupt`: damaged, else another namespace, token
        sequence or codec version): delete them now and overwrite on the next upload of those keys."""
        keys = [bytes(key) for key in keys]
        with self._lock:
            self._distrusted.update(keys)
            if corrupt:
                self._counters.corrupt += len(keys)
        if self.config.read_only:
            return
        for key in keys:
            name = self.object_name(key)
            result = self._call("deleting a bad object",
                                lambda name=name: self._client.delete_object(Bucket=self.config.bucket, Key=name))
            if result is not _FAILED:
                with self._lock:
                    self._counters.deletes += 1
                log.info("remote cache %s: deleted bad object %s", self.config.url, name)

    def store_now(self, items: Sequence[tuple[bytes, Buffer]]) -> list[str | None]:
        """Upload each (key, value) now, up to `max_concurrency` at once, bypassing the write-behind queue; per item
        `UPLOADED`, `PRESENT` (the same value was there: not sent again) or None (not stored: the remote failed or
        is cooling down, read-only or closed). Never raises: the caller keeps what was not stored."""
        if self.config.read_only or self._closed or not items:
            return [None] * len(items)
        jobs = {bytes(key): UploadJob(bytes(key), value, overwrite=bytes(key) in self._distrusted)
                for key, value in items}
        outcomes = dict(zip(jobs, self._parallel(lambda key: self._upload(jobs[key]), list(jobs))))
        return [outcomes[bytes(key)] for key, _ in items]

    def _upload(self, job: UploadJob) -> str | None:
        """Upload one value unless the same one is there (runs on a writer thread; never raises): `UPLOADED`,
        `PRESENT`, or None when it was dropped."""
        if not self._usable():
            with self._lock:
                self._counters.puts_dropped += 1
            return None
        name = self.object_name(job.key)
        crc = value_crc32(job.value)
        if self.config.check_existing and not job.overwrite and crc is not None:
            head = self._call("looking up before a write", lambda: self._client.head_object(
                Bucket=self.config.bucket, Key=name))
            if head is _FAILED:
                with self._lock:
                    self._counters.puts_dropped += 1
                return None
            if head is not _MISSING and _same_value(head, crc, len(job.value)):
                with self._lock:
                    self._counters.puts_skipped += 1
                return PRESENT
        metadata = {CRC_METADATA: f"{crc:08x}"} if crc is not None else {}
        body = job.value if not isinstance(job.value, memoryview) else job.value.tobytes()
        result = self._call("writing", lambda: self._client.put_object(
            Bucket=self.config.bucket, Key=name, Body=body, Metadata=metadata,
            ContentType="application/octet-stream"), missing_is_failure=True)
        with self._lock:
            if result is _FAILED:
                self._counters.puts_dropped += 1
                return None
            self._counters.puts += 1
            self._counters.bytes_written += len(job.value)
            self._distrusted.discard(job.key)
        return UPLOADED

    # ------------------------------------------------------------------------------------------- calls
    def _usable(self) -> bool:
        """Whether calls go out now. After a failure they do not, until a background probe (started once the
        cool-down is over) finds the remote answering again: no request ever waits on a remote that failed."""
        if not self.health.down:
            return True
        if self.health.available():
            with self._lock:
                start = not self._probing and not self._closed
                self._probing = self._probing or start
            if start:
                threading.Thread(target=self._probe, name="hypic-remote-probe", daemon=True).start()
        return False

    def _probe(self) -> None:
        try:
            self._call("checking whether it is back", lambda: self._client.head_bucket(Bucket=self.config.bucket),
                       missing_is_failure=True, probe=True)
        finally:
            with self._lock:
                self._probing = False

    def _call(
        self, what: str, call: Callable[[], _T], *, missing_is_failure: bool = False, probe: bool = False
    ) -> _T | object:
        """Run one client call: its result, `_MISSING` (no such object), or `_FAILED` (failed or not tried)."""
        if not probe and not self._usable():
            with self._lock:
                self._counters.skipped += 1
            return _FAILED
        try:
            result = call()
        except self._client_error_type as error:
            response = getattr(error, "response", {}) or {}
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("NoSuchKey", "404", "NotFound") and not missing_is_failure:
                self.health.succeeded()
                return _MISSING
            reason = _client_error_reason(code, status, self.config.bucket)
        except self._client_errors as error:
            reason = f"{type(error).__name__}: {error}"
        else:
            self.health.succeeded()
            return result
        with self._lock:
            self._counters.errors += 1
        self.health.failed(what, " ".join(reason.split()))
        return _FAILED

    def _parallel(self, function: Callable[[bytes], _T], keys: list[bytes]) -> list[_T]:
        if len(keys) <= 1 or self.config.max_concurrency == 1:
            return [function(key) for key in keys]
        with self._lock:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(self.config.max_concurrency, thread_name_prefix="hypic-remote-read")
            readers = self._readers
        return list(readers.map(function, keys))

    # ------------------------------------------------------------------------------------------- admin
    def inventory(self) -> RemoteInventory | None:
        """Objects and bytes under the prefix, per namespace digest (one LIST request per 1000 objects); None
        when the remote fails (the reason is `health.last_error`)."""
        prefix = f"{self.config.prefix}/" if self.config.prefix else ""

        def listing() -> RemoteInventory:
            inventory = RemoteInventory()
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.config.bucket, Prefix=prefix):
                for item in page.get("Contents", ()):
                    namespace, _, rest = item["Key"][len(prefix):].partition("/")
                    if not rest:
                        continue  # not one of ours
                    inventory.objects += 1
                    inventory.bytes += int(item.get("Size", 0))
                    inventory.per_namespace[namespace] = inventory.per_namespace.get(namespace, 0) + 1
            return inventory

        result = self._call("listing", listing, missing_is_failure=True)
        return result if isinstance(result, RemoteInventory) else None

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for queued uploads (True when none is left; False if `timeout_s` passed first)."""
        return True if self._writer is None else self._writer.flush(timeout_s)

    def stats(self) -> dict[str, Any]:
        """This process's counters as ``remote_<name>``, plus remote_url, remote_available (not cooling down),
        remote_last_error, and the write queue (remote_queue_entries, remote_queue_bytes)."""
        with self._lock:
            counters = asdict(self._counters)
        writer = self._writer
        result: dict[str, Any] = {"remote_url": self.config.url}
        result.update({f"remote_{name}": value for name, value in counters.items()})
        result["remote_available"] = not self.health.down
        result["remote_last_error"] = self.health.last_error or ""
        result["remote_queue_entries"] = writer.pending_entries if writer is not None else 0
        result["remote_queue_bytes"] = writer.pending_bytes if writer is not None else 0
        return result

    def close(self, timeout_s: float | None = CLOSE_TIMEOUT_S) -> None:
        """Wait up to `timeout_s` for queued uploads, then release threads and connections (idempotent)."""
        if self._closed:
            return
        if self._writer is not None:
            left = self._writer.close(timeout_s)
            with self._lock:
                self._counters.puts_dropped += left
        self._closed = True
        if self._readers is not None:
            self._readers.shutdown(wait=True)
        self._client.close()

    def __enter__(self) -> RemoteTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _same_value(head: Any, crc: int, length: int) -> bool:
    """Whether a HEAD response describes an object of this crc32 and length."""
    metadata = head.get("Metadata") or {}
    return int(head.get("ContentLength", -1)) == length and metadata.get(CRC_METADATA) == f"{crc:08x}"


def _client_error_reason(code: str, status: int | None, bucket: str) -> str:
    """One line for a refused call, naming the usual causes."""
    if code in ("NoSuchBucket",) or (code in ("404", "NotFound") and status == 404):
        return f"bucket {bucket!r} does not exist (HTTP 404)"
    if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"):
        return f"access denied ({code}, HTTP {status}): check the credentials and the bucket's policy"
    return f"{code or 'error'} (HTTP {status})"
