"""Settings of the shared remote cache tier (S3-compatible object storage), without importing its client.

    config = RemoteTierConfig.from_url("s3://bucket/hypic/segments", endpoint_url="http://127.0.0.1:9000")
    config.bucket, config.prefix   # "bucket", "hypic/segments"

Plain, frozen and picklable (a Ray task or actor can carry it and build its own `remote_tier.RemoteTier`); every
field is checked here, so a bad URL or option is refused (`RemoteTierConfigError`, bad input) before anything
loads. Credentials are not part of it: the client finds them the standard AWS way (environment variables
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and the shared files,
instance roles). See docs/cache.md, "Remote tier".
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from hypic_rag.cache.errors import RemoteTierConfigError

SCHEME = "s3"
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_PREFIX_PART = re.compile(r"[A-Za-z0-9!\-_.*'()]+")  # S3's "safe characters" for object key names


@dataclass(frozen=True, slots=True)
class RemoteTierConfig:
    """Where the remote tier lives and how hard a request to it may try.

    bucket, prefix: objects are named ``<prefix>/<namespace digest hex>/<token ids digest hex>`` in `bucket`
    (prefix "" puts them at the top of the bucket). endpoint_url: an S3-compatible server (None: AWS, or the
    ``AWS_ENDPOINT_URL(_S3)`` environment variable). region: None lets the client decide (``AWS_REGION``,
    profile; us-east-1 otherwise). connect_timeout_s / read_timeout_s: per socket connect and per read (not per
    transfer). max_attempts: tries per call, first included (botocore's standard retry mode: 5xx, throttling,
    connection errors). cooldown_s / max_cooldown_s: after a failure the tier is skipped (lookups miss at once,
    writes are dropped) until a background probe finds it answering; the first probe goes out `cooldown_s`
    after the failure, each further one after twice the previous wait, up to `max_cooldown_s`.
    warn_interval_s: at most one warning per interval (the others are counted and summarised in the next one).
    max_concurrency: parallel requests of one batched lookup or of the writer. queue_bytes: encoded bytes the
    write-behind queue holds; wait_when_full: a put waits for room (precompute) instead of being dropped
    (ask, serve). write_behind: writes go through a background queue (False: each put waits for the upload).
    read_only: never write (lookups only). check_existing: before uploading, ask whether the object is already
    there with the same checksum (one small request, saves uploading ~100 MB entries twice).
    """

    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None
    region: str | None = None
    connect_timeout_s: float = 1.0
    read_timeout_s: float = 3.0
    max_attempts: int = 2
    cooldown_s: float = 5.0
    max_cooldown_s: float = 60.0
    warn_interval_s: float = 60.0
    max_concurrency: int = 8
    queue_bytes: int = 1 << 30
    wait_when_full: bool = False
    write_behind: bool = True
    read_only: bool = False
    check_existing: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.bucket, str) or not _BUCKET.fullmatch(self.bucket) or ".." in self.bucket:
            raise RemoteTierConfigError(
                f"not an S3 bucket name: {self.bucket!r} (3-63 lowercase letters, digits, dots and hyphens)"
            )
        prefix = self.prefix.strip("/")
        for part in prefix.split("/") if prefix else ():
            if not _PREFIX_PART.fullmatch(part) or part in (".", ".."):
                raise RemoteTierConfigError(
                    f"remote cache prefix {self.prefix!r}: each part must be letters, digits and !-_.*'() "
                    "(no empty parts, '.' or '..')"
                )
        object.__setattr__(self, "prefix", prefix)
        if self.endpoint_url is not None:
            parts = urlsplit(self.endpoint_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise RemoteTierConfigError(
                    f"not an endpoint URL: {self.endpoint_url!r} (e.g. http://127.0.0.1:9000)"
                )
        for name in ("connect_timeout_s", "read_timeout_s", "cooldown_s", "max_cooldown_s", "warn_interval_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
                raise RemoteTierConfigError(f"RemoteTierConfig.{name} must be a positive number, got {value!r}")
        for name in ("max_attempts", "max_concurrency", "queue_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RemoteTierConfigError(f"RemoteTierConfig.{name} must be an integer >= 1, got {value!r}")

    @classmethod
    def from_url(cls, url: str, *, endpoint_url: str | None = None, **options: object) -> RemoteTierConfig:
        """``s3://bucket[/prefix]`` plus any other field by name; `RemoteTierConfigError` for anything else."""
        parts = urlsplit(url.strip()) if isinstance(url, str) else None
        if parts is None or parts.scheme != SCHEME or not parts.netloc:
            raise RemoteTierConfigError(f"not a remote cache URL: {url!r} (expected s3://BUCKET[/PREFIX])")
        if parts.query or parts.fragment or "@" in parts.netloc or ":" in parts.netloc:
            raise RemoteTierConfigError(f"not a remote cache URL: {url!r} (expected s3://BUCKET[/PREFIX])")
        return cls(bucket=parts.netloc, prefix=parts.path, endpoint_url=endpoint_url, **options)  # type: ignore[arg-type]

    @property
    def url(self) -> str:
        """``s3://bucket/prefix`` (what logs, statistics and messages show)."""
        return f"{SCHEME}://{self.bucket}/{self.prefix}" if self.prefix else f"{SCHEME}://{self.bucket}"

    def with_options(self, **options: object) -> RemoteTierConfig:
        """A copy with some fields changed (checked again)."""
        return replace(self, **options)  # type: ignore[arg-type]
