"""`precompute --ray` on a local 2-CPU Ray cluster: the same index and byte-identical cache entries as a local run,
its ingest feeder predicting the writer's embedding batches, a killed driver (SIGKILL, mid-encode) resumed, and a
query whose chunks all miss encoded on actors with the local answer. Without `--ray`, Ray is never imported."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hypic_rag.cache.errors import CacheOpenError
from hypic_rag.cache.keys import CacheNamespace, segment_key
from hypic_rag.cache.lmdb_store import LmdbSegmentStore
from hypic_rag.distributed.ray_scale_out import RayScaleOut
from hypic_rag.retrieval.corpus_index import CorpusIndex
from hypic_rag.retrieval.manifest import IndexManifest
from hypic_rag.pipeline.precompute import PrecomputeConfig, precompute
from hypic_rag.testing import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
WORDS = (
    "harbor lighthouse keeper river bridge market bakery train station mountain valley forest village "
    "captain engineer painter teacher winter summer lantern copper granite orchard mill tower"
).split()
CHUNK_TOKENS = 32
DOCUMENTS = 28
DEADLINE_S = 240


def write_corpus(root: Path, documents: int, paragraphs: int, seed: int = 7) -> Path:
    rng = random.Random(seed)
    root.mkdir(parents=True)
    for number in range(documents):
        text = "\n\n".join(
            " ".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 10))).capitalize() + "."
                     for _ in range(rng.randint(2, 4)))
            for _ in range(paragraphs)
        )
        (root / f"doc{number:02d}.txt").write_text(f"Document {number}.\n\n{text}\n", encoding="utf-8")
    (root / "broken.txt").write_bytes(b"\x00binary")  # a skip: named the same way on Ray
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "docs", documents=DOCUMENTS, paragraphs=3)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    texts = [path.read_text() for path in sorted(corpus.glob("doc*.txt"))]
    return save_tiny_checkpoint(tmp_path_factory.mktemp("model"), texts)


def options(corpus: Path, index: Path, model: Path, **changes: Any) -> PrecomputeConfig:
    values: dict[str, Any] = dict(corpus=corpus, index_dir=index, model_path=model, chunk_tokens=CHUNK_TOKENS,
                                  device="cpu", show_progress=False)
    values.update(changes)
    return PrecomputeConfig(**values)


@pytest.fixture(scope="module")
def local_index(tmp_path_factory: pytest.TempPathFactory, corpus: Path, model: Path) -> Path:
    index = tmp_path_factory.mktemp("local") / "index"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the actors run: a batch's bytes depend on torch's thread count (docs/scale.md)
    try:
        precompute(options(corpus, index, model))
    finally:
        torch.set_num_threads(threads)
    return index


def cache_contents(index: Path) -> dict[bytes, bytes]:
    with LmdbSegmentStore.open(index / "segment_cache", readonly=True) as store:
        return {key: bytes(store.get(key, touch=False)) for key in store.keys()}


def cached_entries(index: Path) -> int:
    try:
        with LmdbSegmentStore.open(index / "segment_cache", readonly=True) as store:
            return store.counters().entries
    except CacheOpenError:
        return 0


def index_rows(index: Path) -> tuple[list[tuple], Any, list[int]]:
    with CorpusIndex.open(index) as opened:
        chunks = list(opened.docstore.iter_chunks())
        rows = sorted((c.vector_id, c.chunk_id, c.doc_id, c.position, c.text, tuple(c.token_ids)) for c in chunks)
        ids = opened.docstore.live_vector_ids()
        return rows, opened.docstore.embeddings(ids), sorted(opened.vectors.live_ids().tolist())


def assert_same_index(first: Path, second: Path) -> None:
    rows_a, vectors_a, live_a = index_rows(first)
    rows_b, vectors_b, live_b = index_rows(second)
    assert rows_a == rows_b and live_a == live_b == [row[0] for row in rows_a]
    assert vectors_a.tobytes() == vectors_b.tobytes()  # the embedder saw the same batches
    assert IndexManifest.load(first).counts == IndexManifest.load(second).counts
    entries_a, entries_b = cache_contents(first), cache_contents(second)
    assert entries_a.keys() == entries_b.keys() and len(entries_a) > 20
    assert all(entries_a[key] == entries_b[key] for key in entries_a)  # byte-identical entries


def test_without_ray_nothing_imports_it() -> None:
    code = ("import sys; import hypic_rag.cli.main, hypic_rag.cli.precompute_command, hypic_rag.cli.serve_command, "
            "hypic_rag.pipeline.precompute, hypic_rag.server.backend, hypic_rag.server.app; "
            "hypic_rag.cli.main.build_parser(); print(sorted(m for m in sys.modules if m.split('.')[0] == 'ray'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def remote_contents(local_s3: Any, bucket: str) -> dict[bytes, bytes]:
    """The bucket's objects under `segments/`, keyed by the cache keys their names spell (namespace | ids digest)."""
    return {bytes.fromhex("".join(name.split("/")[-2:])): value
            for name, value in local_s3.objects(bucket, "segments/").items()}


def test_distributed_precompute_writes_the_local_entries_to_the_remote_tier_from_the_actors(
    ray_cluster: Any, local_s3: Any, corpus: Path, model: Path, local_index: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`precompute --ray --remote-cache`: the index is the local run's, and the actors write every entry straight
    to the remote tier as the local run's exact bytes (nothing through the driver's disk); entries missing from
    the remote are encoded again on a rerun (resumable), and a second host's `ask` is served from remote hits."""
    from hypic_rag.cache.remote_config import RemoteTierConfig
    from hypic_rag.cli.main import main
    from hypic_rag.cli.precompute_command import remote_summary_line
    from kits.s3 import aws_test_environment

    bucket = local_s3.new_bucket()
    remote = RemoteTierConfig.from_url(f"s3://{bucket}/segments", endpoint_url=local_s3.url)
    index = tmp_path / "index"
    with aws_test_environment():
        summary = precompute(options(corpus, index, model, scale_out=RayScaleOut(), remote_cache=remote))
        assert summary.encode.encoded == summary.encode.segments == summary.encode.stored_remotely > 20
        assert summary.encode.uploaded_remotely == summary.encode.encoded and summary.cache_bytes == 0
        assert summary.remote["remote_puts_by_encoders"] == summary.remote["remote_puts"] == summary.encode.encoded
        assert "of them by the encoding actors" in remote_summary_line(summary.remote)
        assert [str(skip) for skip in summary.skipped] == ["broken.txt: binary file"]
        rows_local, vectors_local, _ = index_rows(local_index)
        rows_ray, vectors_ray, _ = index_rows(index)
        assert rows_local == rows_ray and vectors_local.tobytes() == vectors_ray.tobytes()
        assert cached_entries(index) == 0  # not one entry went through the driver's disk
        expected = cache_contents(local_index)
        assert remote_contents(local_s3, bucket) == expected  # the local run's keys and bytes

        client = local_s3.client()  # a run stopped before its last uploads: three entries never reached the remote
        lost = sorted(local_s3.objects(bucket, "segments/"))[:3]
        for name in lost:
            client.delete_object(Bucket=bucket, Key=name)
        resumed = precompute(options(corpus, index, model, scale_out=RayScaleOut(actors=1), remote_cache=remote))
        assert resumed.encode.encoded == resumed.encode.stored_remotely == 3 and not resumed.ingest.changed
        assert remote_contents(local_s3, bucket) == expected

        second_host = Path(shutil.copytree(index, tmp_path / "second_host"))  # the index, an empty local cache
        code = main(["ask", "Where does the captain keep the lantern?", "--index", str(second_host), "--device",
                     "cpu", "--top-k", "3", "--max-new-tokens", "4", "--json", "--remote-cache",
                     f"s3://{bucket}/segments", "--remote-endpoint", local_s3.url])
    printed = capsys.readouterr().out
    assert code == 0, printed
    usage = json.loads(printed)["usage"]
    assert usage["cache_misses"] == 0 and usage["cache_hits"] == 4  # the prefix and 3 chunks, all remote hits
    assert cached_entries(second_host) == 4  # the remote hits filled the second host's disk


def test_ingest_feeder_predicts_every_embedding_batch(ray_cluster: Any, corpus: Path, model: Path, tmp_path: Path) -> None:
    """Small embedding batches and chunking tasks, a short lookahead: the feeder's batches are the writer's."""
    from hypic_rag.distributed.ray_ingest import IngestFeeder
    from hypic_rag.retrieval.chunking import Chunker, ChunkerConfig
    from hypic_rag.retrieval.corpus_index import IndexConfig
    from hypic_rag.retrieval.embeddings import SentenceEmbedder
    from hypic_rag.retrieval.loading import load_corpus
    from hypic_rag.retrieval.manifest import ModelIdentity
    from hypic_rag.runtime.model import load_model

    loaded = load_corpus(corpus)
    loaded.documents[:] = loaded.documents[:12]
    tiny = load_model(model, device="cpu", require_tokenizer=True)
    chunker = Chunker(tiny.tokenizer, ChunkerConfig(chunk_tokens=CHUNK_TOKENS))
    settings = IndexConfig(model=ModelIdentity.of(model, tiny), chunker=chunker.config, embed_batch_chunks=8)
    embedder = SentenceEmbedder()
    reports, feeders = [], []
    for name, distributed in (("here", False), ("ray", True)):
        with CorpusIndex.open_for_update(tmp_path / name, embedder, settings) as index:
            hooks = {}
            if distributed:
                feeder = IngestFeeder(ray_cluster, index, loaded, chunker, lookahead=5, documents_per_task=2)
                feeders.append(feeder)
                hooks = {"cut": feeder.cut, "embed": feeder.embed}
            reports.append(index.ingest(loaded, chunker, **hooks))
    assert reports[0] == reports[1] and reports[0].chunks_added > 24
    assert feeders[0].embed_batches > 3 and feeders[0].mispredicted == 0
    for name in ("here", "ray"):
        (tmp_path / name / "segment_cache").mkdir(exist_ok=True)
    rows_here, vectors_here, _ = index_rows(tmp_path / "here")
    rows_ray, vectors_ray, _ = index_rows(tmp_path / "ray")
    assert rows_here == rows_ray and vectors_here.tobytes() == vectors_ray.tobytes()


def test_killed_distributed_precompute_resumes(
    ray_cluster: Any, ray_address: str, corpus: Path, model: Path, local_index: Path, tmp_path: Path
) -> None:
    index = Path(shutil.copytree(local_index, tmp_path / "index"))  # documents indexed; the kill is mid-encode
    shutil.rmtree(index / "segment_cache")
    command = [sys.executable, "-m", "hypic_rag", "precompute", str(corpus), "--index", str(index), "--model",
               str(model), "--chunk-tokens", str(CHUNK_TOKENS), "--device", "cpu", "--no-progress",
               "--ray", ray_address, "--ray-actors", "1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1")
    victim = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while cached_entries(index) < 8:  # the first transaction of entries encoded on the actor is stored
            assert victim.poll() is None, victim.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the distributed precompute never stored an entry"
            time.sleep(0.01)
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    assert victim.returncode == -signal.SIGKILL
    stored = cached_entries(index)

    rerun = precompute(options(corpus, index, model, scale_out=RayScaleOut(address=ray_address, actors=2)))
    encoded_now, segments = rerun.encode.encoded, rerun.encode.segments
    assert 0 < encoded_now == segments - stored < segments  # the killed run had stored some; only the rest ran
    assert rerun.ingest.documents_unchanged == DOCUMENTS  # every document was committed before the kill
    manifest = IndexManifest.load(index)
    namespace = CacheNamespace(manifest.model.fingerprint, manifest.model.tokenizer_fingerprint, manifest.seam_tokens)
    with CorpusIndex.open(index) as opened:
        chunks = list(opened.docstore.iter_chunks())
        assert len({c.chunk_id for c in chunks}) == len(chunks) == manifest.counts["chunks"]  # every chunk once
        with LmdbSegmentStore.open(index / "segment_cache", readonly=True) as store:
            assert all(store.contains(segment_key(namespace, c.token_ids)) for c in chunks)
    assert_same_index(local_index, index)


def test_all_miss_query_encoded_on_actors_equals_the_local_answer(
    ray_cluster: Any, copy_tiny_index, tmp_path: Path
) -> None:
    from hypic_rag.distributed.ray_encoder import pool_for_engine
    from hypic_rag.pipeline.answering import RagPipeline
    from hypic_rag.runtime.sampling import SamplingParams
    from kits.corpora import SMALL_CORPUS_QUESTIONS

    answers, pools = {}, []
    for name in ("local", "actors"):
        index = copy_tiny_index(tmp_path / name)
        shutil.rmtree(index / "segment_cache")  # nothing cached: every segment of the prompt misses
        pipeline = RagPipeline.open(index, device="cpu", hop_slots=0)
        try:
            pipeline.engine.encode_batch_tokens = 96  # one chunk per batch: the misses spread over both actors
            if name == "actors":
                pool = pool_for_engine(ray_cluster, pipeline.engine, pipeline.session.model_path, actors=2)
                pools.append(pool.start())
                pipeline.engine.miss_encoder = pool
            question = SMALL_CORPUS_QUESTIONS["lavender.md"]
            answer = pipeline.answer(question, top_k=4, params=SamplingParams(max_new_tokens=8))
            answers[name] = answer
            if name == "actors":
                counters = pool.counters()
                assert len(counters) == 2 and all(c["tokens"] > 0 for c in counters)  # both actors encoded
        finally:
            pipeline.close()
            for pool in pools:
                pool.close()
    local, remote = answers["local"], answers["actors"]
    assert remote.usage["cache_hits"] == 0 and remote.usage["cache_misses"] == local.usage["cache_misses"] >= 4
    assert remote.token_ids == local.token_ids and remote.text == local.text and remote.token_ids
    entries_local, entries_actors = cache_contents(tmp_path / "local"), cache_contents(tmp_path / "actors")
    assert entries_local.keys() == entries_actors.keys() and len(entries_local) >= 4
    assert all(entries_local[key] == entries_actors[key] for key in entries_local)
