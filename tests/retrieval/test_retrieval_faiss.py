"""The FAISS vector index (flat, HNSW, IVF) and the SQLite docstore, on real FAISS and real files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hypic_rag.retrieval.chunking import Chunk
from hypic_rag.retrieval.docstore import DocStore
from hypic_rag.retrieval.faiss_index import VectorIndex, VectorIndexConfig
from hypic_rag.retrieval.loading import Document

DIMENSION = 16


def unit_vectors(count: int, seed: int = 0) -> np.ndarray:
    vectors = np.random.default_rng(seed).standard_normal((count, DIMENSION)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


@pytest.mark.parametrize("kind", ["flat", "hnsw", "ivf"])
def test_add_search_remove_save_load(tmp_path: Path, kind: str) -> None:
    vectors = unit_vectors(300)
    ids = np.arange(1000, 1300)
    index = VectorIndex(DIMENSION, VectorIndexConfig(kind=kind, ivf_lists=4, ivf_probe=4))
    index.add(ids, vectors)
    assert len(index) == 300
    scores, found = index.search(vectors[:20], 3)
    assert (found[:, 0] == ids[:20]).mean() >= 0.9
    assert np.allclose(scores[found[:, 0] == ids[:20], 0], 1.0, atol=1e-4)

    removed = index.remove(ids[:10])
    assert removed == 10 and len(index) == 290
    _, found = index.search(vectors[:10], 5)
    assert not np.isin(found, ids[:10]).any()
    assert sorted(index.live_ids().tolist()) == ids[10:].tolist()

    path = tmp_path / "vectors.faiss"
    index.save(path)
    reloaded = VectorIndex.load(path, DIMENSION, index.config)
    assert sorted(reloaded.stored_ids().tolist()) == sorted(index.stored_ids().tolist())
    # tombstones are not persisted: a sync against the live ids restores them (see test_sync_*)
    reloaded.sync(ids[10:], lambda wanted: vectors[np.searchsorted(ids, wanted)])
    _, found = reloaded.search(vectors[10:30], 1)
    assert (found[:, 0] == ids[10:30]).mean() >= 0.9
    assert not np.isin(reloaded.search(vectors[:10], 5)[1], ids[:10]).any()


@pytest.mark.parametrize("kind", ["flat", "hnsw", "ivf"])
def test_sync_adds_missing_and_drops_extra_ids_exactly_once(kind: str) -> None:
    vectors = unit_vectors(120, seed=1)
    ids = np.arange(120)
    index = VectorIndex(DIMENSION, VectorIndexConfig(kind=kind, ivf_lists=2))
    index.add(ids[:80], vectors[:80])
    fetched: list[int] = []

    def fetch(wanted: np.ndarray) -> np.ndarray:
        fetched.extend(wanted.tolist())
        return vectors[wanted]

    live = np.concatenate([ids[20:80], ids[100:]])  # 0..19 deleted, 80..99 never added, 100..119 new
    result = index.sync(live, fetch)
    assert (result.added, result.removed) == (20, 20)
    assert sorted(fetched) == ids[100:].tolist()
    assert sorted(index.live_ids().tolist()) == sorted(live.tolist())
    again = index.sync(live, fetch)
    assert (again.added, again.removed) == (0, 0)
    assert len(set(index.live_ids().tolist())) == len(index) == len(live)


def test_hnsw_compacts_when_tombstones_pile_up() -> None:
    vectors = unit_vectors(100, seed=2)
    index = VectorIndex(DIMENSION, VectorIndexConfig(kind="hnsw", compact_fraction=0.25))
    index.add(np.arange(100), vectors)
    index.sync(np.arange(20, 100), lambda wanted: vectors[wanted])  # 20% tombstones: kept
    assert len(index.stored_ids()) == 100 and len(index) == 80
    index.sync(np.arange(40, 100), lambda wanted: vectors[wanted])  # 40%: rebuilt from the live vectors
    assert sorted(index.stored_ids().tolist()) == list(range(40, 100))
    assert len(index) == 60


def test_empty_index_and_bad_input() -> None:
    index = VectorIndex(DIMENSION, VectorIndexConfig())
    scores, ids = index.search(unit_vectors(2), 3)
    assert scores.shape == ids.shape == (2, 0)  # k is capped at the vectors held
    index.add([1, 2], unit_vectors(2))
    _, ids = index.search(unit_vectors(1), 4)
    assert sorted(ids[0].tolist()) == [1, 2]
    with pytest.raises(ValueError, match="shape"):
        index.add([3], np.zeros((1, DIMENSION + 1), np.float32))
    with pytest.raises(ValueError, match="kind"):
        VectorIndexConfig(kind="annoy")
    with pytest.raises(ValueError, match="compact_fraction"):
        VectorIndexConfig(compact_fraction=0.0)


def _chunk(doc_id: str, position: int, text: str) -> Chunk:
    return Chunk(f"{doc_id}-{text}", doc_id, position, text, tuple(range(position, position + 5)), 0, len(text))


def test_docstore_replaces_documents_in_place_and_never_reuses_vector_ids(tmp_path: Path) -> None:
    store = DocStore(tmp_path / "docstore.sqlite")
    document = Document("doc", "a b c", "doc.txt", {"lang": "en"})
    chunks = [_chunk("doc", 0, "a"), _chunk("doc", 1, "b"), _chunk("doc", 2, "c")]
    embeddings = {c.chunk_id: np.full(DIMENSION, i, np.float32) for i, c in enumerate(chunks)}
    assert store.replace_document(document, "/root", chunks, embeddings) == (3, 0)
    first_ids = store.live_vector_ids().tolist()

    edited = [_chunk("doc", 0, "a"), _chunk("doc", 1, "B"), _chunk("doc", 2, "c")]
    assert store.replace_document(document, "/root", edited, {"doc-B": np.ones(DIMENSION, np.float32)}) == (1, 1)
    ids = store.live_vector_ids().tolist()
    assert ids[:1] == first_ids[:1] and first_ids[1] not in ids and max(ids) > max(first_ids)
    stored = store.chunks(ids)
    assert [c.text for c in sorted(stored, key=lambda c: c.position)] == ["a", "B", "c"]
    assert stored[0].metadata == {"lang": "en"} and stored[0].source == "doc.txt"
    assert stored[0].token_ids == (0, 1, 2, 3, 4)
    assert np.array_equal(store.embeddings([ids[-1]])[0], np.ones(DIMENSION, np.float32))

    with pytest.raises(ValueError, match="no embedding"):
        store.replace_document(document, "/root", [_chunk("doc", 0, "new")], {})
    assert store.counts().chunks == 3  # the failed replacement changed nothing

    store.close()
    reopened = DocStore(tmp_path / "docstore.sqlite")
    assert reopened.document_ids_from_root("/root") == ["doc"]
    assert reopened.delete_document("doc") == 3
    counts = reopened.counts()
    assert (counts.documents, counts.chunks, counts.tokens) == (0, 0, 0)
    reopened.replace_document(Document("doc2", "z", "z"), "/root", [_chunk("doc2", 0, "z")], {"doc2-z": np.zeros(DIMENSION)})
    assert reopened.live_vector_ids().tolist()[0] > max(ids)
    reopened.close()
