"""A precompute subprocess killed midway (SIGKILL, during cache encoding) and rerun (through the CLI's `main` in this
process) finishes the job: every chunk is in the index exactly once and in the cache, and the rerun encodes only what
the killed run had not stored."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hypic_rag.cache.errors import CacheOpenError
from hypic_rag.cache.keys import CacheNamespace, segment_key
from hypic_rag.cache.lmdb_store import LmdbSegmentStore
from hypic_rag.retrieval.corpus_index import CorpusIndex
from hypic_rag.retrieval.manifest import IndexManifest
from hypic_rag.pipeline.precompute import PrecomputeOptions, precompute
from hypic_rag.testing import save_tiny_checkpoint
from hypic_rag.cli.in_process import run_cli_here

WORDS = (
    "harbor lighthouse keeper river bridge market bakery train station mountain valley forest village "
    "captain engineer painter teacher winter summer lantern copper granite orchard mill tower"
).split()
CHUNK_TOKENS = 32
KILL_AFTER_ENTRIES = 12
DEADLINE_SECONDS = 240


DOCUMENTS = 16


def write_corpus(root: Path, documents: int = DOCUMENTS, paragraphs: int = 5) -> Path:
    rng = random.Random(7)
    root.mkdir(parents=True)
    for number in range(documents):
        text = "\n\n".join(
            " ".join(
                " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 10))).capitalize() + "."
                for _ in range(rng.randint(2, 4))
            )
            for _ in range(paragraphs)
        )
        (root / f"doc{number:02d}.txt").write_text(f"Document {number}.\n\n{text}\n", encoding="utf-8")
    return root


def precompute_command(corpus: Path, index: Path, model: Path) -> list[str]:
    entry = "import sys; from hypic_rag.cli.main import main; sys.exit(main())"  # what the console script runs
    return [sys.executable, "-c", entry, "precompute", str(corpus), "--index", str(index),
            "--model", str(model), "--chunk-tokens", str(CHUNK_TOKENS), "--no-progress"]


def child_environment() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def cached_entries(cache_dir: Path) -> int:
    try:
        with LmdbSegmentStore.open(cache_dir, readonly=True) as store:
            return store.counters().entries
    except CacheOpenError:  # not created yet, or created but not initialised yet
        return 0


def test_killed_precompute_resumes_and_indexes_every_chunk_once(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    model = save_tiny_checkpoint(tmp_path / "model", [p.read_text() for p in sorted(corpus.iterdir())])
    index = tmp_path / "index"
    command = precompute_command(corpus, index, model)

    victim = subprocess.Popen(command, env=child_environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + DEADLINE_SECONDS
        while cached_entries(index / "segment_cache") < KILL_AFTER_ENTRIES:
            assert victim.poll() is None, "precompute finished before it could be killed: make the corpus larger"
            assert time.monotonic() < deadline, "precompute never reached the encoding phase"
            time.sleep(0.05)
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    assert victim.returncode == -signal.SIGKILL
    stored_before_rerun = cached_entries(index / "segment_cache")

    rerun = run_cli_here(*command[3:])  # the same command, through the CLI's `main` in this process
    assert rerun.returncode == 0, rerun.stderr
    encoded = re.search(r"^encoded: (\d+) of (\d+) segments", rerun.stdout, flags=re.MULTILINE)
    assert encoded, rerun.stdout
    encoded_now, segments = int(encoded.group(1)), int(encoded.group(2))
    assert encoded_now == segments - stored_before_rerun and 0 < encoded_now < segments
    assert f"documents: {DOCUMENTS} (0 added" in rerun.stdout  # every document had been committed before the kill

    manifest = IndexManifest.load(index)
    namespace = CacheNamespace(manifest.model.fingerprint, manifest.model.tokenizer_fingerprint, manifest.seam_tokens)
    with CorpusIndex.open(index) as opened:
        chunks = list(opened.docstore.iter_chunks())
        vector_ids = opened.vectors.live_ids().tolist()
        assert len(vector_ids) == len(set(vector_ids)) == len(chunks) == manifest.counts["chunks"]
        assert sorted(vector_ids) == sorted(chunk.vector_id for chunk in chunks)
        assert len({chunk.chunk_id for chunk in chunks}) == len(chunks)
        assert {chunk.doc_id for chunk in chunks} == {f"doc{n:02d}.txt" for n in range(DOCUMENTS)}
    with LmdbSegmentStore.open(index / "segment_cache", readonly=True) as store:
        assert all(store.contains(segment_key(namespace, chunk.token_ids)) for chunk in chunks)
        assert store.counters().entries == segments

    again = precompute(PrecomputeOptions(corpus=corpus, index_dir=index, model_path=model,
                                         chunk_tokens=CHUNK_TOKENS, show_progress=False))
    assert not again.did_work and again.chunks == len(chunks)


@pytest.mark.parametrize("path_kind", ["file", "directory"])
def test_precompute_cli_fails_fast_without_loading_models(tmp_path: Path, path_kind: str) -> None:
    target = tmp_path / "absent"
    if path_kind == "directory":
        target.mkdir()
    began = time.monotonic()
    result = subprocess.run(precompute_command(target, tmp_path / "index", tmp_path / "model"),
                            env=child_environment(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    message = "does not exist" if path_kind == "file" else "holds no .txt, .md, .jsonl, .pdf, .html or .docx document"
    assert result.stderr.count("\n") == 1 and message in result.stderr and "Traceback" not in result.stderr
    assert time.monotonic() - began < 60
