"""CorpusIndex end to end on real files, the shipped MiniLM embedder and real FAISS: ingest, search, re-ingest,
edit, delete, add later, mismatched settings, repair after an interrupted save, locking."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from hypic_rag.retrieval.chunking import Chunker, ChunkerConfig
from hypic_rag.retrieval.corpus_index import VECTORS_FILE, CorpusIndex, IndexConfig
from hypic_rag.retrieval.embeddings import SentenceEmbedder, default_embedder_path
from hypic_rag.retrieval.errors import IndexMismatchError, IndexNotFoundError, RetrievalError
from hypic_rag.retrieval.faiss_index import VectorIndexConfig
from hypic_rag.retrieval.loading import load_corpus
from hypic_rag.retrieval.manifest import ModelIdentity
from hypic_rag.testing import train_tiny_tokenizer

FACTS = {
    "lighthouse.md": [
        "The lighthouse of Kerran stands on the northern cliff.",
        "It was built in 1821 by the engineer Ada Vell. Its lamp burns whale oil and is visible for thirty miles.",
        "The keeper today is Jonas Pell, who climbs its 212 steps every evening.",
    ],
    "bakery.txt": [
        "The Brindle bakery opens at five in the morning.",
        "It sells rye bread every Tuesday and honey cakes on Sundays. The owner is Tomas Quill.",
    ],
    "mountains/aster.md": [
        "Mount Aster is the highest peak of the Varn range.",
        "The summit of Mount Aster is 4120 metres above sea level and covered in snow all year.",
    ],
    "trains.txt": [
        "The night train from Ostra to Velm leaves at 22:40.",
        "The journey takes nine hours and the dining car serves beetroot soup.",
    ],
}
MODEL = ModelIdentity(path="tiny-model", fingerprint="model-fingerprint-a", tokenizer_fingerprint="tokenizer-a")


def write_corpus(root: Path, facts: dict[str, list[str]] = FACTS) -> Path:
    for name, paragraphs in facts.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def embedder() -> SentenceEmbedder:
    return SentenceEmbedder()


@pytest.fixture(scope="module")
def chunker() -> Chunker:
    texts = [" ".join(paragraphs) for paragraphs in FACTS.values()]
    return Chunker(train_tiny_tokenizer(texts * 3), ChunkerConfig(chunk_tokens=32))


def settings(**changes) -> IndexConfig:
    base = dict(model=MODEL, chunker=ChunkerConfig(chunk_tokens=32))
    base.update(changes)
    return IndexConfig(**base)


def top_doc(index: CorpusIndex, question: str) -> str:
    return index.search(question, k=1)[0].chunk.doc_id


def doc_vector_ids(index: CorpusIndex) -> dict[str, set[int]]:
    by_doc: dict[str, set[int]] = {}
    for chunk in index.docstore.iter_chunks():
        by_doc.setdefault(chunk.doc_id, set()).add(chunk.vector_id)
    return by_doc


def assert_index_consistent(index: CorpusIndex) -> None:
    live = index.docstore.live_vector_ids()
    stored = index.vectors.live_ids()
    assert len(set(stored.tolist())) == len(stored) == len(index.vectors)
    assert sorted(stored.tolist()) == sorted(live.tolist())


def test_ingest_then_search_finds_the_chunk_holding_the_answer(tmp_path, embedder, chunker) -> None:
    corpus = load_corpus(write_corpus(tmp_path / "corpus"))
    with CorpusIndex.open_for_update(tmp_path / "index", embedder, settings()) as index:
        report = index.ingest(corpus, chunker)
        assert report.documents_added == 4 and report.chunks_added == index.counts().chunks > 4
        assert top_doc(index, "Who is the keeper of the lighthouse?") == "lighthouse.md"
        hit = index.search("How high is the summit of Mount Aster?", k=3)[0]
        assert hit.chunk.doc_id == "mountains/aster.md" and "4120" in hit.chunk.text
        assert 0.3 < hit.score <= 1.0001
        assert top_doc(index, "When does the night train leave?") == "trains.txt"
        assert_index_consistent(index)
    manifest = (tmp_path / "index" / "manifest.json").read_text()
    assert '"chunks": ' in manifest and "all-MiniLM-L6-v2" in manifest and "model-fingerprint-a" in manifest
    with CorpusIndex.open(tmp_path / "index") as reader:  # loads the embedder the manifest names
        assert top_doc(reader, "What does the bakery sell on Tuesday?") == "bakery.txt"
        with pytest.raises(RetrievalError, match="search only"):
            reader.ingest(corpus, chunker)


def test_reingest_edit_add_and_delete_touch_only_what_changed(tmp_path, embedder, chunker) -> None:
    root = write_corpus(tmp_path / "corpus")
    with CorpusIndex.open_for_update(tmp_path / "index", embedder, settings()) as index:
        index.ingest(load_corpus(root), chunker)
        before = doc_vector_ids(index)
        files = [tmp_path / "index" / name for name in (VECTORS_FILE, "manifest.json")]
        stamps = [path.stat().st_mtime_ns for path in files]

        unchanged = index.ingest(load_corpus(root), chunker)
        assert (unchanged.documents_unchanged, unchanged.chunks_added, unchanged.chunks_removed) == (4, 0, 0)
        assert not unchanged.changed and doc_vector_ids(index) == before
        assert [path.stat().st_mtime_ns for path in files] == stamps  # nothing rewritten

        edited = dict(FACTS)
        edited["lighthouse.md"] = FACTS["lighthouse.md"][:2] + ["The keeper today is Mira Stone, a retired sailor."]
        write_corpus(root, {"lighthouse.md": edited["lighthouse.md"]})
        report = index.ingest(load_corpus(root), chunker)
        assert (report.documents_updated, report.documents_unchanged) == (1, 3)
        after = doc_vector_ids(index)
        assert {doc: ids for doc, ids in after.items() if doc != "lighthouse.md"} == {
            doc: ids for doc, ids in before.items() if doc != "lighthouse.md"
        }
        kept = after["lighthouse.md"] & before["lighthouse.md"]
        assert kept and report.chunks_added == len(after["lighthouse.md"] - kept) >= 1
        assert report.chunks_removed == len(before["lighthouse.md"] - kept)
        assert any("Mira Stone" in hit.chunk.text for hit in index.search("Who keeps the lighthouse today?", k=3))
        assert not any("Jonas Pell" in chunk.text for chunk in index.docstore.iter_chunks())

        (root / "ferries.txt").write_text("The ferry to Lune island departs from pier six at noon.\n")
        added = index.ingest(load_corpus(root), chunker)
        assert (added.documents_added, added.documents_unchanged) == (1, 4)
        assert top_doc(index, "Where does the ferry to Lune island depart from?") == "ferries.txt"

        (root / "bakery.txt").unlink()
        deleted = index.ingest(load_corpus(root), chunker)
        assert deleted.documents_deleted == 1 and deleted.chunks_removed == len(before["bakery.txt"])
        assert "bakery.txt" not in doc_vector_ids(index)
        hits = index.search("What does the bakery sell?", k=20)
        assert hits and all(hit.chunk.doc_id != "bakery.txt" for hit in hits)
        assert_index_consistent(index)

        assert index.delete_document("trains.txt") == len(before["trains.txt"])
        assert all(hit.chunk.doc_id != "trains.txt" for hit in index.search("night train", k=20))
        assert_index_consistent(index)


def test_documents_of_another_corpus_root_are_kept(tmp_path, embedder, chunker) -> None:
    first = write_corpus(tmp_path / "first", {"a.txt": FACTS["bakery.txt"]})
    second = write_corpus(tmp_path / "second", {"b.txt": FACTS["trains.txt"]})
    with CorpusIndex.open_for_update(tmp_path / "index", embedder, settings()) as index:
        index.ingest(load_corpus(first), chunker)
        report = index.ingest(load_corpus(second), chunker)
        assert (report.documents_added, report.documents_deleted) == (1, 0)
        assert set(doc_vector_ids(index)) == {"a.txt", "b.txt"}


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_approximate_indexes_add_and_delete_without_rebuild(tmp_path, embedder, chunker, kind) -> None:
    root = write_corpus(tmp_path / "corpus")
    with CorpusIndex.open_for_update(tmp_path / "index", embedder, settings(vector_index=VectorIndexConfig(kind=kind))) as index:
        index.ingest(load_corpus(root), chunker)
        (root / "bakery.txt").unlink()
        index.ingest(load_corpus(root), chunker)
        assert all(hit.chunk.doc_id != "bakery.txt" for hit in index.search("rye bread", k=10))
        assert_index_consistent(index)
    with CorpusIndex.open(tmp_path / "index", embedder) as reader:
        assert reader.manifest.vector_index.kind == kind
        assert top_doc(reader, "How high is Mount Aster?") == "mountains/aster.md"
        assert_index_consistent(reader)


def test_index_built_otherwise_is_refused(tmp_path, embedder, chunker) -> None:
    root = write_corpus(tmp_path / "corpus")
    with CorpusIndex.open_for_update(tmp_path / "index", embedder, settings()) as index:
        index.ingest(load_corpus(root), chunker)
    other_model = ModelIdentity("other", "model-fingerprint-b", "tokenizer-a")
    with pytest.raises(IndexMismatchError, match="built for model tiny-model"):
        CorpusIndex.open_for_update(tmp_path / "index", embedder, settings(model=other_model))
    other_tokenizer = ModelIdentity("tiny-model", "model-fingerprint-a", "tokenizer-b")
    with pytest.raises(IndexMismatchError, match="another tokenizer"):
        CorpusIndex.open_for_update(tmp_path / "index", embedder, settings(model=other_tokenizer))
    with pytest.raises(IndexMismatchError, match="--chunk-tokens"):
        CorpusIndex.open_for_update(tmp_path / "index", embedder, settings(chunker=ChunkerConfig(chunk_tokens=64)))
    with pytest.raises(IndexMismatchError, match="seam_tokens=8"):
        CorpusIndex.open_for_update(tmp_path / "index", embedder, settings(seam_tokens=4))
    with pytest.raises(IndexMismatchError, match="'flat' FAISS index"):
        CorpusIndex.open_for_update(tmp_path / "index", embedder, settings(vector_index=VectorIndexConfig(kind="hnsw")))

    # another embedder: the shipped model's files with one setting changed (weights linked, not copied)
    other_dir = tmp_path / "other-embedder"
    shutil.copytree(default_embedder_path(), other_dir, ignore=shutil.ignore_patterns("model.safetensors"))
    (other_dir / "model.safetensors").symlink_to(default_embedder_path() / "model.safetensors")
    (other_dir / "sentence_bert_config.json").write_text('{"max_seq_length": 128, "do_lower_case": false}')
    other_embedder = SentenceEmbedder(other_dir)
    assert other_embedder.identity.dimension == embedder.identity.dimension
    with pytest.raises(IndexMismatchError, match="built with embedder all-MiniLM-L6-v2"):
        CorpusIndex.open_for_update(tmp_path / "index", other_embedder, settings())
    with pytest.raises(IndexMismatchError, match="embedder"):
        CorpusIndex.open(tmp_path / "index", other_embedder)
    with pytest.raises(IndexNotFoundError, match="run precompute first"):
        CorpusIndex.open(tmp_path / "no-index", embedder)


def test_a_stale_faiss_file_is_repaired_on_open(tmp_path, embedder, chunker) -> None:
    root = write_corpus(tmp_path / "corpus", {"bakery.txt": FACTS["bakery.txt"]})
    vectors_path = tmp_path / "index" / VECTORS_FILE
    with CorpusIndex.open_for_update(tmp_path / "index", embedder, settings()) as index:
        index.ingest(load_corpus(root), chunker)
        stale = vectors_path.read_bytes()
        write_corpus(root)
        index.ingest(load_corpus(root), chunker)
        chunks = index.counts().chunks
    vectors_path.write_bytes(stale)  # as if killed after the docstore commits, before the FAISS save
    with CorpusIndex.open_for_update(tmp_path / "index", embedder, settings()) as index:
        assert len(index.vectors) == chunks
        assert_index_consistent(index)
        assert top_doc(index, "When does the night train leave?") == "trains.txt"
    vectors_path.unlink()
    with CorpusIndex.open(tmp_path / "index", embedder) as reader:
        assert len(reader.vectors) == chunks


def test_one_writer_at_a_time(tmp_path, embedder) -> None:
    with CorpusIndex.open_for_update(tmp_path / "index", embedder, settings()):
        with pytest.raises(RetrievalError, match="being written by another process"):
            CorpusIndex.open_for_update(tmp_path / "index", embedder, settings())
    with CorpusIndex.open_for_update(tmp_path / "index", embedder, settings()) as index:
        assert index.counts().chunks == 0
        scores, ids = index.vectors.search(np.zeros((1, embedder.dimension), np.float32) + 0.05, 2)
        assert ids.shape == (1, 0)


def test_ingest_steps_bound_each_step_and_give_what_ingest_gives(tmp_path, embedder, chunker) -> None:
    """The stepwise ingest (the service's document jobs) yields between bounded pieces of work and leaves the
    same documents, chunks and search results as `ingest`; closed between steps, the index stays consistent."""
    corpus = load_corpus(write_corpus(tmp_path / "corpus"))
    with CorpusIndex.open_for_update(tmp_path / "whole", embedder, settings()) as whole:
        expected = whole.ingest(corpus, chunker)
        expected_chunks = sorted((c.chunk_id, c.token_ids) for c in whole.docstore.iter_chunks())
    with CorpusIndex.open_for_update(tmp_path / "stepped", embedder, settings()) as index:
        steps = index.ingest_steps(corpus, chunker, step_chunks=2)
        yields = []
        while True:
            try:
                yields.append(next(steps))
            except StopIteration as done:
                report = done.value
                break
        assert len(yields) >= expected.chunks_added // 2  # at least one yield per 2 chunks embedded
        assert yields == sorted(yields) and yields[-1] == len(corpus.documents)
        assert report == expected
        assert sorted((c.chunk_id, c.token_ids) for c in index.docstore.iter_chunks()) == expected_chunks
        assert top_doc(index, "Who is the keeper of the lighthouse?") == "lighthouse.md"
        assert_index_consistent(index)
    with CorpusIndex.open_for_update(tmp_path / "stopped", embedder, settings()) as index:
        steps = index.ingest_steps(corpus, chunker, step_chunks=2)
        while next(steps) < 2:  # two documents stored, the rest not yet
            pass
        steps.close()
    with CorpusIndex.open(tmp_path / "stopped", embedder) as reopened:  # FAISS catches up with the docstore
        assert reopened.counts().documents == 2
        assert_index_consistent(reopened)


def test_a_reader_follows_its_writer_and_finds_what_a_fresh_reader_finds(tmp_path, embedder, chunker) -> None:
    """`follow_writer`: a search-only index opened before the writer's changes catches up with them (the workers of
    a writable `serve`), added and deleted documents alike; without the call it keeps its own snapshot."""
    root = write_corpus(tmp_path / "corpus", {name: FACTS[name] for name in ("lighthouse.md", "trains.txt")})
    with CorpusIndex.open_for_update(tmp_path / "index", embedder, settings()) as writer:
        writer.ingest(load_corpus(root), chunker)
        with CorpusIndex.open(tmp_path / "index", embedder) as reader:
            assert reader.follow_writer() is None  # nothing committed since it opened
            write_corpus(root, {"bakery.txt": FACTS["bakery.txt"]})
            writer.ingest(load_corpus(root), chunker)
            question = "What does the bakery sell on Tuesday?"
            assert top_doc(reader, question) != "bakery.txt"  # its own snapshot until it follows
            joined = reader.follow_writer()
            assert joined and {chunk.doc_id for chunk in joined} == {"bakery.txt"}
            assert top_doc(reader, question) == "bakery.txt"
            assert reader.follow_writer() is None
            assert_index_consistent(reader)
            writer.delete_document("bakery.txt")
            assert reader.follow_writer() == []  # only a deletion
            assert all(hit.chunk.doc_id != "bakery.txt" for hit in reader.search(question, k=20))
            with CorpusIndex.open(tmp_path / "index", embedder) as fresh:
                for probe in (question, "Who keeps the lighthouse?", "When does the night train leave?"):
                    assert ([(hit.chunk.chunk_id, round(hit.score, 5)) for hit in reader.search(probe, k=4)]
                            == [(hit.chunk.chunk_id, round(hit.score, 5)) for hit in fresh.search(probe, k=4)])
