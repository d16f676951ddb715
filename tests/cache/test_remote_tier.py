"""The shared remote cache tier against a real S3-compatible server on 127.0.0.1 (moto's server mode).

Two temporary cache directories stand for two hosts sharing one bucket. Checked: bytes round trip bit-exact through
the codec (the object holds exactly the local store's value), host B serves host A's entries as remote hits and
answers identically, a corrupt object is detected by its crc32, deleted, recomputed and replaced by good bytes,
puts are idempotent, a remote that fails in any way (refused, timing out, 403, 503, no bucket, stopped in the
middle of a query) costs misses and one warning but never an error or a wrong answer, and the CLI (`ask`,
`precompute`, `cache stats`) and a real `serve` process on 127.0.0.1 use the tier.

Every server (moto's, and the small failing ones) is real and listens on 127.0.0.1. moto keeps its buckets in this
process, so a second `ThreadedMotoServer` on another port serves the same buckets and can be stopped on its own.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("boto3")
pytest.importorskip("moto.server")

from hypic_rag.cache.codec import encode_entry  # noqa: E402
from hypic_rag.cache.keys import CacheNamespace, segment_key  # noqa: E402
from hypic_rag.cache.lmdb_store import LmdbSegmentStore  # noqa: E402
from hypic_rag.cache.remote_config import RemoteTierConfig  # noqa: E402
from hypic_rag.cache.remote_tier import CRC_METADATA, RemoteTier  # noqa: E402
from hypic_rag.cache.remote_writer import UploadJob, WriteBehindQueue  # noqa: E402
from hypic_rag.cache.segment_cache import SegmentCache  # noqa: E402
from hypic_rag.cache.synthetic import TINY_SHAPE, synthetic_entry  # noqa: E402
from hypic_rag.cache.errors import RemoteTierConfigError  # noqa: E402
from hypic_rag.cli.main import main  # noqa: E402
from hypic_rag.pipeline.answering import RagPipeline  # noqa: E402
from hypic_rag.pipeline.precompute import PrecomputeConfig, precompute  # noqa: E402
from hypic_rag.runtime.modes import PREFIX_ENTRY_SEAM  # noqa: E402
from hypic_rag.runtime.sampling import SamplingParams  # noqa: E402
from hypic_rag.testing import free_port  # noqa: E402
from kits.corpora import SMALL_CORPUS_QUESTIONS  # noqa: E402
from kits.s3 import TEST_AWS_ENV as AWS_ENV  # noqa: E402
from kits.s3 import LocalS3 as MotoServer  # noqa: E402  (moto's server on 127.0.0.1)
from storage_support import fetch_or_make_many  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
NS = CacheNamespace(model_fingerprint="m", tokenizer_fingerprint="t", seam_tokens=8)
CHUNKS = [list(range(start, start + 24)) for start in range(0, 24 * 6, 24)]
QUESTION = SMALL_CORPUS_QUESTIONS["glassblowing.md"]
PARAMS = SamplingParams(max_new_tokens=6)
REMOTE_LOG = "hypic_rag.cache.remote_health"


# ------------------------------------------------------------------------------------------------ servers
@pytest.fixture(scope="module", autouse=True)
def aws_environment() -> Iterator[None]:
    """Credentials for the local server (standard AWS variables; children inherit them), no instance metadata."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in AWS_ENV.items():
            patch.setenv(name, value)
        patch.delenv("AWS_PROFILE", raising=False)
        patch.delenv("AWS_ENDPOINT_URL", raising=False)
        yield


@pytest.fixture(scope="module")
def s3(aws_environment: None) -> Iterator[MotoServer]:
    server = MotoServer()
    yield server
    server.stop()


def s3_client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint)


@pytest.fixture
def bucket(s3: MotoServer) -> str:
    """A new, empty bucket on the module's server."""
    name = f"hypic-{uuid.uuid4().hex[:12]}"
    s3_client(s3.url).create_bucket(Bucket=name)
    return name


def tier(endpoint: str, bucket: str, **options) -> RemoteTier:
    options.setdefault("cooldown_s", 0.2)
    return RemoteTier.from_url(f"s3://{bucket}/hosts/shared", endpoint_url=endpoint, **options)


def encode_synthetic(missing: list[list[int]]) -> list[dict[str, torch.Tensor]]:
    return [synthetic_entry(TINY_SHAPE, ids) for ids in missing]


def objects(endpoint: str, bucket: str) -> dict[str, bytes]:
    client = s3_client(endpoint)
    listed = client.list_objects_v2(Bucket=bucket).get("Contents", [])
    return {item["Key"]: client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read() for item in listed}


def remote_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == REMOTE_LOG and r.levelno == logging.WARNING]


# ------------------------------------------------------------------------------------------------ configuration
@pytest.mark.parametrize("url", ["http://bucket/x", "s3://", "s3://Bad_Bucket/x", "s3://bucket/a//b", "s3://ab",
                                 "s3://bucket/x?y=1", "s3://user@bucket/x", "s3://bucket/../x"])
def test_bad_urls_are_refused_as_bad_input(url: str) -> None:
    with pytest.raises(RemoteTierConfigError) as raised:
        RemoteTierConfig.from_url(url)
    assert raised.value.exit_code == 2 and "\n" not in str(raised.value)


def test_config_names_objects_safely_and_pickles() -> None:
    import pickle

    config = RemoteTierConfig.from_url("s3://my-bucket/a/b/", endpoint_url="http://127.0.0.1:9")
    assert (config.bucket, config.prefix, config.url) == ("my-bucket", "a/b", "s3://my-bucket/a/b")
    remote = RemoteTier(config)
    key = segment_key(NS, CHUNKS[0])
    assert remote.object_name(key) == f"a/b/{key[:16].hex()}/{key[16:].hex()}"
    clone = pickle.loads(pickle.dumps(remote))  # a Ray task or actor rebuilds its own client
    assert isinstance(clone, RemoteTier) and clone.config == config
    for made in (remote, clone):
        made.close()
    with pytest.raises(RemoteTierConfigError):
        RemoteTierConfig.from_url("s3://my-bucket", endpoint_url="127.0.0.1:9000")


# ------------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("cache_format", ["float32", "int4"])
def test_round_trip_is_bit_exact_and_a_remote_hit_fills_the_local_tiers(
    s3: MotoServer, bucket: str, tmp_path: Path, cache_format: str
) -> None:
    namespace = CacheNamespace(model_fingerprint="m", tokenizer_fingerprint="t", seam_tokens=8,
                               cache_format=cache_format)
    with SegmentCache.open(tmp_path / "a", namespace=namespace, remote=tier(s3.url, bucket)) as host_a:
        made, hits = fetch_or_make_many(host_a, namespace, CHUNKS, encode_synthetic)
        assert not any(hits)
        assert host_a.flush_remote(30)
        assert host_a.stats()["remote_puts"] == len(CHUNKS)
    stored = objects(s3.url, bucket)
    with LmdbSegmentStore.open(tmp_path / "a", readonly=True) as store_a:
        local_a = {key: bytes(store_a.get(key)) for key in store_a.keys()}
    remote = tier(s3.url, bucket)
    assert {remote.object_name(key): value for key, value in local_a.items()} == stored  # the same bytes, by name
    metadata = s3_client(s3.url).head_object(Bucket=bucket, Key=remote.object_name(next(iter(local_a))))["Metadata"]
    assert metadata[CRC_METADATA] == f"{int.from_bytes(next(iter(local_a.values()))[12:16], 'little'):08x}"

    def never(missing: list[list[int]]) -> list[dict[str, torch.Tensor]]:
        raise AssertionError(f"host B encoded {len(missing)} chunks that host A had stored")

    with SegmentCache.open(tmp_path / "b", namespace=namespace, remote=remote) as host_b:
        other = list(range(1000, 1010))
        assert host_b.contains_many(8, [*CHUNKS, other]) == [True] * len(CHUNKS) + [False]  # what host A uploaded is held
        served, hits = fetch_or_make_many(host_b, namespace, CHUNKS, never)
        assert all(hits)
        for mine, theirs in zip(made, served):
            assert mine.keys() == theirs.keys()
            for name in mine:
                assert mine[name].dtype == theirs[name].dtype and torch.equal(mine[name], theirs[name]), name
        stats = host_b.stats()
        assert (stats["remote_hits"], stats["remote_misses"], stats["disk_hits"]) == (len(CHUNKS), 0, 0)
        assert stats["remote_bytes_read"] == sum(len(value) for value in stored.values())
        assert stats["hot_entries"] == len(CHUNKS)
        again, hits = fetch_or_make_many(host_b, namespace, CHUNKS, never)  # now from the hot tier
        assert all(hits) and host_b.stats()["remote_lookups"] == len(CHUNKS)
    with LmdbSegmentStore.open(tmp_path / "b", readonly=True) as store_b:  # the disk tier was filled, same bytes
        assert {key: bytes(store_b.get(key)) for key in store_b.keys()} == local_a


def test_puts_are_idempotent(s3: MotoServer, bucket: str) -> None:
    value = encode_entry(synthetic_entry(TINY_SHAPE, CHUNKS[0]), NS.canonical())
    key = segment_key(NS, CHUNKS[0])
    client = s3_client(s3.url)
    with tier(s3.url, bucket, write_behind=False) as remote:
        assert remote.put_many([(key, value)]) == 1
        first = client.head_object(Bucket=bucket, Key=remote.object_name(key))
        assert remote.put_many([(key, value), (key, bytes(value))]) == 2  # the same bytes: nothing uploaded
        stats = remote.stats()
        assert (stats["remote_puts"], stats["remote_puts_skipped"]) == (1, 2)
        again = client.head_object(Bucket=bucket, Key=remote.object_name(key))
        assert again["ETag"] == first["ETag"] and again["LastModified"] == first["LastModified"]
    with tier(s3.url, bucket) as queued:  # write-behind: the same check on the writer thread
        assert queued.put_many([(key, value)] * 3) == 3
        assert queued.flush(30)
        stats = queued.stats()
        assert stats["remote_puts"] == 0 and stats["remote_puts_skipped"] >= 1
    assert objects(s3.url, bucket) == {remote.object_name(key): bytes(value)}


def test_write_behind_queue_is_bounded_by_bytes() -> None:
    started, release = threading.Event(), threading.Event()
    uploaded: list[bytes] = []

    def upload(job: UploadJob) -> None:
        started.set()
        release.wait(30)
        uploaded.append(job.key)

    dropping = WriteBehindQueue(upload, max_bytes=20, wait_when_full=False, workers=1, name="test")
    assert dropping.submit(UploadJob(b"first", b"1234"))
    assert started.wait(10)  # the worker holds "first" until released
    assert dropping.submit(UploadJob(b"a", b"12345678"))
    assert dropping.submit(UploadJob(b"a", b"12345678"))  # already queued: accepted, queued once
    assert (dropping.pending_entries, dropping.pending_bytes) == (2, 12)
    assert dropping.submit(UploadJob(b"big", b"1" * 100)) is False  # over the bound: dropped (ask, serve)
    assert dropping.dropped == 1
    release.set()
    assert dropping.flush(10) and uploaded == [b"first", b"a"] and dropping.pending_bytes == 0
    assert dropping.submit(UploadJob(b"big", b"1" * 100))  # an empty queue takes even an oversized value
    assert dropping.close(10) == 0 and uploaded[-1] == b"big"

    started.clear()
    release.clear()
    waiting = WriteBehindQueue(upload, max_bytes=10, wait_when_full=True, workers=1, name="test")
    waiting.submit(UploadJob(b"c", b"12345678"))
    assert started.wait(10)
    done = threading.Event()
    threading.Thread(target=lambda: (waiting.submit(UploadJob(b"d", b"12345678")), done.set()), daemon=True).start()
    assert not done.wait(0.3)  # precompute's queue waits for room instead of dropping
    release.set()
    assert done.wait(10) and waiting.flush(10) and uploaded[-2:] == [b"c", b"d"]
    waiting.close(1)


# ------------------------------------------------------------------------------------------------ corruption
def test_a_corrupt_object_is_detected_deleted_and_replaced_by_good_bytes(
    s3: MotoServer, bucket: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with SegmentCache.open(tmp_path / "a", namespace=NS, remote=tier(s3.url, bucket)) as host_a:
        fetch_or_make_many(host_a, NS, CHUNKS, encode_synthetic)
        assert host_a.flush_remote(30)
    good = objects(s3.url, bucket)
    remote = tier(s3.url, bucket)
    damaged_name = remote.object_name(segment_key(NS, CHUNKS[2]))
    damaged = bytearray(good[damaged_name])
    damaged[len(damaged) // 2] ^= 0x40  # one flipped bit in the payload; the metadata still names the good crc32
    client = s3_client(s3.url)
    metadata = client.head_object(Bucket=bucket, Key=damaged_name)["Metadata"]
    client.put_object(Bucket=bucket, Key=damaged_name, Body=bytes(damaged), Metadata=metadata)

    encoded: list[list[int]] = []

    def encode(missing: list[list[int]]) -> list[dict[str, torch.Tensor]]:
        encoded.extend(missing)
        return encode_synthetic(missing)

    with caplog.at_level(logging.WARNING, logger="hypic_rag.cache"):
        with SegmentCache.open(tmp_path / "b", namespace=NS, remote=remote) as host_b:
            served, hits = fetch_or_make_many(host_b, NS, CHUNKS, encode)
            assert encoded == [CHUNKS[2]] and hits == [True, True, False, True, True, True]
            for ids, entry in zip(CHUNKS, served):  # every entry right, the recomputed one included
                expected = synthetic_entry(TINY_SHAPE, ids)
                assert all(torch.equal(entry[name], expected[name]) for name in expected)
            assert host_b.flush_remote(30)
            stats = host_b.stats()
            assert (stats["remote_corrupt"], stats["remote_deletes"], stats["corrupt"]) == (1, 1, 1)
            assert stats["remote_puts"] == 1  # the recomputed entry, uploaded over whatever was there
    assert any("corrupt cache entry" in message and "crc32" in message for message in caplog.messages)
    assert objects(s3.url, bucket) == good  # the bucket holds good bytes again


# ------------------------------------------------------------------------------------------------ failures
class FailingS3(http.server.ThreadingHTTPServer):
    """A real HTTP server on 127.0.0.1 answering every request with one S3 error status."""

    def __init__(self, status: int, code: str) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                body = f"<Error><Code>{code}</Code><Message>{code}</Message></Error>".encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(0 if self.command == "HEAD" else len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.requests = 0
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture
def silent_port() -> Iterator[str]:
    """An endpoint that accepts connections and never answers (a hung server)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def refused_endpoint() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


@pytest.mark.parametrize("failure", ["refused", "timeout", "access denied", "server error", "no bucket"])
def test_a_failing_remote_is_a_miss_and_one_warning(
    failure: str, s3: MotoServer, silent_port: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bucket = "hypic-missing-bucket"
    servers: list[FailingS3] = []
    if failure == "refused":
        endpoint = refused_endpoint()
    elif failure == "timeout":
        endpoint = silent_port
    elif failure == "no bucket":
        endpoint = s3.url
    else:
        servers.append(FailingS3(403, "AccessDenied") if failure == "access denied" else FailingS3(503, "SlowDown"))
        endpoint = servers[0].url
    remote = tier(endpoint, bucket, read_timeout_s=0.3, connect_timeout_s=0.3, cooldown_s=30)
    try:
        with caplog.at_level(logging.WARNING, logger="hypic_rag.cache"):
            began = time.monotonic()
            with SegmentCache.open(tmp_path / "cache", namespace=NS, remote=remote) as cache:
                entries, hits = fetch_or_make_many(cache, NS, CHUNKS[:3], encode_synthetic)
                assert hits == [False] * 3
                assert all(torch.equal(e["layers.0.transition"], synthetic_entry(TINY_SHAPE, ids)["layers.0.transition"])
                           for e, ids in zip(entries, CHUNKS))
                first = time.monotonic() - began
                more, hits = fetch_or_make_many(cache, NS, CHUNKS[3:], encode_synthetic)  # cooling down: not asked
                assert hits == [False] * 3
                assert all(cache.contains_many(8, CHUNKS))  # the disk tier has them all now
                stats = cache.stats()
            elapsed = time.monotonic() - began
    finally:
        for server in servers:
            server.shutdown()
    assert stats["remote_errors"] >= 1 and stats["remote_skipped"] >= 3 and stats["remote_hits"] == 0
    assert stats["remote_available"] is False and stats["remote_last_error"]
    warnings = remote_warnings(caplog)
    assert len(warnings) == 1, warnings  # rate-limited: one warning, however many calls failed
    expected = {"refused": "Could not connect", "timeout": "timeout", "access denied": "access denied",
                "server error": "SlowDown", "no bucket": "does not exist"}[failure]
    assert expected.lower() in warnings[0].lower(), warnings[0]
    assert first < 10 and elapsed < 12, (first, elapsed)  # short timeouts, bounded retries, then skipped


def test_the_remote_coming_back_ends_the_cool_down(s3: MotoServer, bucket: str, tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    own = MotoServer()
    own.stop()  # down from the start
    with caplog.at_level(logging.WARNING, logger="hypic_rag.cache"):
        with SegmentCache.open(tmp_path / "c", namespace=NS, remote=tier(own.url, bucket, cooldown_s=0.2)) as cache:
            fetch_or_make_many(cache, NS, CHUNKS[:2], encode_synthetic)
            cache.flush_remote(10)
            assert cache.stats()["remote_puts"] == 0
            back = MotoServer(own.port)
            try:
                time.sleep(0.3)  # past the cool-down: the next call starts a probe in the background, and misses
                began = time.monotonic()
                assert cache.get_many(NS, CHUNKS[:1])[0] is not None and cache.remote.get_many([b"k" * 48]) == [None]
                assert time.monotonic() - began < 1
                deadline = time.monotonic() + 10
                while cache.remote.health.down and time.monotonic() < deadline:
                    time.sleep(0.05)
                    cache.remote.get_many([b"k" * 48])  # starts a probe whenever a cool-down is over
                assert not cache.remote.health.down, "the probe found the remote back"
                fetch_or_make_many(cache, NS, CHUNKS[2:4], encode_synthetic)
                assert cache.flush_remote(30)
                assert cache.publish(NS, CHUNKS[:4]) == 2  # what the outage kept from the remote
                assert cache.flush_remote(30)
                stats = cache.stats()
            finally:
                back.stop()
    assert stats["remote_available"] is True and stats["remote_puts"] == 4
    assert len(objects(s3.url, bucket)) == 4
    assert any("reachable again" in message for message in remote_warnings(caplog))


# ------------------------------------------------------------------------------------------------ real model
@pytest.fixture(scope="module")
def host_a(tmp_path_factory: pytest.TempPathFactory, copy_tiny_index, tiny_index_master: Path, tiny_model: Path,
           s3: MotoServer) -> tuple[Path, str]:
    """Host A: a copy of the tiny index whose `precompute --remote-cache` run published every entry (nothing to
    encode: the local cache had them); (its index, the bucket)."""
    bucket = f"hypic-{uuid.uuid4().hex[:12]}"
    s3_client(s3.url).create_bucket(Bucket=bucket)
    index = copy_tiny_index(tmp_path_factory.mktemp("host_a") / "index")
    summary = precompute(PrecomputeConfig(
        corpus=tiny_index_master.with_name(tiny_index_master.name + ".corpus"), index_dir=index,
        model_path=tiny_model, chunk_tokens=96, seam_tokens=8, device="cpu", show_progress=False,
        remote_cache=RemoteTierConfig.from_url(f"s3://{bucket}/segments", endpoint_url=s3.url),
    ))
    assert summary.encode.encoded == 0 and summary.remote is not None
    with LmdbSegmentStore.open(index / "segment_cache", readonly=True) as store:
        entries = store.counters().entries
    assert summary.remote["remote_puts"] == entries == len(objects(s3.url, bucket)) > 0
    return index, bucket


@pytest.fixture(scope="module")
def reference(host_a: tuple[Path, str]) -> tuple[list[int], str]:
    """Host A's answer to QUESTION from its own disk cache: (token ids, text)."""
    pipeline = RagPipeline.open(host_a[0], device="cpu")
    try:
        answer = pipeline.answer(QUESTION, top_k=3, params=PARAMS)
    finally:
        pipeline.close()
    return list(answer.token_ids), answer.text


def empty_host(copy_tiny_index, base: Path) -> Path:
    """Another host: a copy of the index without its segment cache."""
    index = copy_tiny_index(base / "index")
    shutil.rmtree(index / "segment_cache")
    return index


def test_host_b_answers_from_host_a_entries_identically(host_a: tuple[Path, str], reference: tuple[list[int], str],
                                                        s3: MotoServer, copy_tiny_index, tmp_path: Path) -> None:
    index_b = empty_host(copy_tiny_index, tmp_path)
    config = RemoteTierConfig.from_url(f"s3://{host_a[1]}/segments", endpoint_url=s3.url)
    pipeline = RagPipeline.open(index_b, device="cpu", remote_cache=config)
    try:
        answer = pipeline.answer(QUESTION, top_k=3, params=PARAMS)
        stats = pipeline.session.segment_source.stats()
    finally:
        pipeline.close()
    assert answer.usage["cache_misses"] == 0 and answer.usage["cache_hits"] == 4  # prefix + 3 chunks, none encoded
    assert (stats["remote_hits"], stats["remote_misses"], stats["remote_puts"]) == (4, 0, 0)
    assert (list(answer.token_ids), answer.text) == reference
    with LmdbSegmentStore.open(index_b / "segment_cache", readonly=True) as store:
        assert store.counters().entries == 4  # the remote hits filled the disk tier


def test_remote_stopped_during_a_query_answers_stay_right(
    host_a: tuple[Path, str], s3: MotoServer, copy_tiny_index, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Reference: the same question on a host with an empty cache and no remote (everything encoded on the spot).
    fresh = RagPipeline.open(empty_host(copy_tiny_index, tmp_path / "fresh"), device="cpu")
    try:
        expected = fresh.answer(QUESTION, top_k=3, params=PARAMS)
    finally:
        fresh.close()
    # A bucket of its own holding host A's chunk entries but not the prompt prefix's, behind its own front end.
    bucket = f"hypic-{uuid.uuid4().hex[:12]}"
    client = s3_client(s3.url)
    client.create_bucket(Bucket=bucket)
    front = MotoServer()
    config = RemoteTierConfig.from_url(f"s3://{bucket}/segments", endpoint_url=front.url, cooldown_s=30,
                                       connect_timeout_s=0.5)
    pipeline = RagPipeline.open(empty_host(copy_tiny_index, tmp_path / "b"), device="cpu", remote_cache=config)
    prefix_namespace = CacheNamespace.for_model(pipeline.session.model, PREFIX_ENTRY_SEAM).digest().hex()
    for item in client.list_objects_v2(Bucket=host_a[1])["Contents"]:
        if f"/{prefix_namespace}/" not in item["Key"]:
            client.copy_object(Bucket=bucket, Key=item["Key"], CopySource={"Bucket": host_a[1], "Key": item["Key"]})
    assert len(objects(s3.url, bucket)) == len(objects(s3.url, host_a[1])) - 1

    encode = pipeline.engine.entries.encode  # where the engine's get-or-encode encodes its misses

    def encode_while_the_remote_goes_away(*args, **kwargs):
        front.stop()  # the prefix missed remotely; the remote is gone before the chunks are looked up
        return encode(*args, **kwargs)

    pipeline.engine.entries.encode = encode_while_the_remote_goes_away
    try:
        with caplog.at_level(logging.WARNING, logger="hypic_rag.cache"):
            answer = pipeline.answer(QUESTION, top_k=3, params=PARAMS)
            again = pipeline.answer(QUESTION, top_k=3, params=PARAMS)  # remote still down: local tiers serve
        stats = pipeline.session.segment_source.stats()
    finally:
        pipeline.close()
    assert list(answer.token_ids) == list(expected.token_ids) and answer.text == expected.text
    assert list(again.token_ids) == list(expected.token_ids) and again.usage["cache_misses"] == 0
    assert answer.usage["cache_misses"] == 4 and stats["remote_hits"] == 0
    assert stats["remote_errors"] >= 1 and stats["remote_puts"] == 0 and stats["remote_available"] is False
    assert len(remote_warnings(caplog)) == 1, remote_warnings(caplog)


def test_precompute_on_another_host_encodes_nothing_the_remote_holds(
    host_a: tuple[Path, str], s3: MotoServer, copy_tiny_index, tiny_index_master: Path, tiny_model: Path,
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    index_b = empty_host(copy_tiny_index, tmp_path)
    corpus = tiny_index_master.with_name(tiny_index_master.name + ".corpus")
    code = main(["precompute", str(corpus), "--index", str(index_b), "--model", str(tiny_model), "--chunk-tokens",
                 "96", "--device", "cpu", "--no-progress", "--remote-cache", f"s3://{host_a[1]}/segments",
                 "--remote-endpoint", s3.url])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "encoded: 0 of" in printed, printed
    assert f"remote: s3://{host_a[1]}/segments: 0 uploaded (0 B), 0 already there, 0 dropped" in printed, printed


# ------------------------------------------------------------------------------------------------ CLI, server
def child_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")


def hypic_rag(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hypic_rag", *argv], capture_output=True, text=True,
                          timeout=timeout, env=child_env())


def test_cli_ask_and_cache_stats_use_the_remote_tier(host_a: tuple[Path, str], reference: tuple[list[int], str],
                                                     s3: MotoServer, copy_tiny_index, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    index_b = empty_host(copy_tiny_index, tmp_path)
    remote = ["--remote-cache", f"s3://{host_a[1]}/segments", "--remote-endpoint", s3.url]
    asked = hypic_rag("ask", QUESTION, "--index", str(index_b), "--top-k", "3", "--max-new-tokens", "6",
                      "--device", "cpu", "--json", *remote)
    assert asked.returncode == 0 and "Traceback" not in asked.stderr and not asked.stderr.strip(), asked.stderr
    answer = json.loads(asked.stdout)
    assert answer["usage"]["cache_misses"] == 0 and answer["answer"] == reference[1]
    # the rest in this process (no model loads)
    cache_dir = str(index_b / "segment_cache")
    assert main(["cache", "stats", "--cache", cache_dir, "--json", *remote]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["entries"] == 4 and data["hits"] == 4  # filled from the remote, nothing encoded
    assert data["remote_objects"] == len(objects(s3.url, host_a[1])) and data["remote_bytes"] > 0
    down = ["--remote-cache", f"s3://{host_a[1]}/segments", "--remote-endpoint", refused_endpoint()]
    assert main(["cache", "stats", "--cache", cache_dir, *down]) == 0
    shown = capsys.readouterr().out
    assert "entries         4" in shown and f"s3://{host_a[1]}/segments: unavailable" in shown, shown
    assert main(["ask", QUESTION, "--index", str(index_b), "--remote-endpoint", s3.url]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "hypic-rag ask: error: --remote-endpoint needs --remote-cache s3://BUCKET[/PREFIX]"]
    with pytest.raises(SystemExit) as exited:
        main(["ask", QUESTION, "--index", str(index_b), "--remote-cache", "http://not-s3/x"])
    assert exited.value.code == 2 and "not a remote cache URL" in capsys.readouterr().err


def test_serve_shares_the_remote_tier(host_a: tuple[Path, str], s3: MotoServer, copy_tiny_index,
                                      tmp_path: Path) -> None:
    index_c = empty_host(copy_tiny_index, tmp_path)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "hypic_rag", "serve", "--index", str(index_c), "--port", str(port), "--device", "cpu",
         "--log-level", "warning", "--remote-cache", f"s3://{host_a[1]}/segments", "--remote-endpoint", s3.url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert server.poll() is None, server.communicate()
        answered = httpx.post(f"{url}/v1/ask", json={"question": QUESTION, "top_k": 3, "max_new_tokens": 4},
                              timeout=120)
        assert answered.status_code == 200, answered.text
        assert answered.json()["usage"]["cache_misses"] == 0
        cache = httpx.get(f"{url}/v1/cache/stats", timeout=30).json()["cache"]
        assert cache["remote_url"] == f"s3://{host_a[1]}/segments" and cache["remote_hits"] == 4
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert "hypic_segment_cache_remote_hits_total 4.0" in metrics
        assert "hypic_segment_cache_remote_up 1.0" in metrics
    finally:
        server.send_signal(signal.SIGTERM)
        _, stderr = server.communicate(timeout=120)
    assert server.returncode == 0 and "Traceback" not in stderr, stderr
