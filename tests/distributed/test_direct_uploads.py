"""An encoding actor writing its entries straight to the remote tier (`EncoderActor.encode_batch_to_remote`, what
`precompute --ray --remote-cache` runs), driven here as the plain class it is (no Ray needed): the object it
uploads holds the bytes a `SegmentCache` stores for the same entry (float32 and bfloat16 storage), a second
upload of the same value is not sent again, and a remote that refuses connections hands every entry back to the
driver, unchanged, instead of losing it. Against a real S3-compatible server on 127.0.0.1 (moto)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hypic_rag.testing import free_port

SEGMENTS = [[5, 9, 13, 2, 7, 7, 1, 30, 4, 18, 22], [3, 3, 8, 41, 6, 12, 2], [17, 5, 9, 60, 11, 2, 8, 8, 9]]
SEAM = 2


@pytest.fixture(scope="module")
def actor(tiny_model: Path) -> Any:
    from hypic_rag.distributed.actors import EncoderActor
    from hypic_rag.retrieval.encoding_pool import EncoderConfig
    from hypic_rag.runtime.model import load_model

    fingerprint = load_model(tiny_model, device="cpu").fingerprint
    spec = EncoderConfig(model_path=str(tiny_model), device="cpu", dtype="float32", seam_tokens=SEAM,
                       fingerprint=fingerprint)
    return EncoderActor(spec, encode_batch_tokens=1024)


@pytest.mark.parametrize("cache_format", ["float32", "int4"])
def test_an_actor_uploads_the_bytes_a_cache_stores_and_keeps_what_the_remote_refuses(
    actor: Any, local_s3: Any, tmp_path: Path, cache_format: str
) -> None:
    from hypic_rag.cache.keys import CacheNamespace, segment_key
    from hypic_rag.cache.lmdb_store import LmdbSegmentStore
    from hypic_rag.cache.remote_config import RemoteTierConfig
    from hypic_rag.cache.segment_cache import SegmentCache
    from hypic_rag.runtime.get_or_encode import StoredRemotely
    from kits.s3 import aws_test_environment

    namespace = CacheNamespace.for_model(actor.engine.model, 8, cache_format=cache_format)
    with SegmentCache.open(tmp_path / "cache", namespace=namespace) as cache:  # the driver's way: one put
        cache.put_many(SEAM, SEGMENTS, actor.engine.encode_segments(SEGMENTS, SEAM))
    with LmdbSegmentStore.open(tmp_path / "cache", readonly=True) as store:
        stored = {key: bytes(store.get(key, touch=False)) for key in store.keys()}

    bucket = local_s3.new_bucket()
    remote = RemoteTierConfig.from_url(f"s3://{bucket}/p", endpoint_url=local_s3.url)
    with aws_test_environment():
        results = actor.encode_batch_to_remote(SEGMENTS, SEAM, namespace, remote)
        again = actor.encode_batch_to_remote(SEGMENTS, SEAM, namespace, remote)
        refused = RemoteTierConfig.from_url(f"s3://{bucket}/p", endpoint_url=f"http://127.0.0.1:{free_port()}")
        kept = actor.encode_batch_to_remote(SEGMENTS, SEAM, namespace, refused)
    assert all(isinstance(result, StoredRemotely) and result.sent for result in results)
    uploaded = {bytes.fromhex("".join(name.split("/")[-2:])): value
                for name, value in local_s3.objects(bucket, "p/").items()}
    bound = namespace.with_seam(SEAM)
    assert set(uploaded) == set(stored) == {segment_key(bound, ids) for ids in SEGMENTS}
    assert uploaded == stored  # byte for byte what the cache stores
    assert [result.value_bytes for result in results] == [len(stored[segment_key(bound, ids)]) for ids in SEGMENTS]
    assert all(isinstance(result, StoredRemotely) and not result.sent for result in again)  # there already
    direct = actor.encode_batch(SEGMENTS, SEAM)
    assert [sorted(entry) for entry in kept] == [sorted(entry) for entry in direct]  # the entries come back whole
    assert all(torch.equal(a[name], b[name]) for a, b in zip(kept, direct) for name in a)
