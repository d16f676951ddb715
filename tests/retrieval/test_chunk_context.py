"""Contextual chunk embeddings and neighbour expansion (`hypic_rag.retrieval.chunk_context`): the pure rules, and
on real indexes (shipped MiniLM, real FAISS) of a generated cross-chunk world, that each raises the recall of the
chunks a cross-chunk question needs (the plain index misses about half of them), that the chunk's tokens stay
its own, and that an index built with one setting refuses another embedding context and takes another expansion."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from hypic_rag.retrieval.chunk_context import (
    DEFAULT_RETRIEVAL,
    LEGACY_RETRIEVAL,
    RetrievalSettings,
    chunk_contexts,
    embedding_text,
    expand_with_neighbours,
)
from hypic_rag.retrieval.chunking import Chunk
from hypic_rag.retrieval.corpus_index import CorpusIndex, IndexConfig
from hypic_rag.retrieval.embeddings import SentenceEmbedder
from hypic_rag.retrieval.errors import IndexMismatchError
from hypic_rag.retrieval.loading import Document, load_corpus
from hypic_rag.retrieval.manifest import MANIFEST_FILE, ModelIdentity


@dataclass(frozen=True)
class _Chunk:
    doc_id: str
    position: int
    chunk_id: str = ""


@dataclass(frozen=True)
class _Hit:
    chunk: _Chunk
    hop_query: str | None = None
    neighbour_of: str | None = None


def _hits(names: str, hops: str = "") -> list[_Hit]:
    """'a0 b1 c0' -> hits of doc a chunk 0, doc b chunk 1, ...; names in `hops` are hop hits."""
    return [_Hit(_Chunk(name[0], int(name[1:]), name), "hop" if name in hops.split() else None)
            for name in names.split()]


def _expand(hits: list[_Hit], k: int, spec: str, stored: str) -> str:
    present = {(name[0], int(name[1:])) for name in stored.split()}
    settings = LEGACY_RETRIEVAL.with_neighbours(spec)
    expanded = expand_with_neighbours(
        hits, k, settings, lambda keys: {key: _Chunk(*key, f"{key[0]}{key[1]}") for key in keys if key in present},
        lambda chunk, source: _Hit(chunk, neighbour_of=source.chunk.chunk_id))
    return " ".join(f"{hit.chunk.doc_id}{hit.chunk.position}{'+' if hit.neighbour_of else ''}" for hit in expanded)


def test_neighbour_rule_takes_at_most_its_slots_from_the_lowest_direct_hits() -> None:
    stored = "a0 a1 a2 b0 b1 c0 c1 d0 e0 h0 h1"
    hits = _hits("a0 b0 c0 d0 e0")
    assert _expand(hits, 5, "none", stored) == "a0 b0 c0 d0 e0"
    assert _expand(hits, 5, "next:1", stored) == "a0 a1+ b0 c0 d0"  # the lowest direct hit gives its place
    assert _expand(hits, 5, "next:2", stored) == "a0 a1+ b0 b1+ c0"
    assert _expand(hits, 5, "next:4", stored) == "a0 a1+ b0 b1+ c0"  # c0 has no place left below it for c1
    assert _expand(hits, 8, "next:2", stored) == "a0 a1+ b0 b1+ c0 d0 e0"  # free places are used first
    # previous and both: a retrieved later chunk brings the one before it
    assert _expand(_hits("a2 d0 e0"), 3, "previous:1", stored) == "a2 a1+ d0"
    assert _expand(_hits("a1 d0 e0"), 3, "both:2", stored) == "a1 a2+ a0+"
    # the retrieval hop's places are kept; a neighbour already retrieved stays beside its hit and brings nothing
    assert _expand(_hits("a0 b0 c0 h0", hops="h0"), 4, "next:2", stored) == "a0 a1+ b0 h0"
    assert _expand(_hits("a0 b0 c0 a1 d0"), 5, "next:2", stored) == "a0 b0 b1+ c0 a1"
    with pytest.raises(ValueError, match="KIND"):
        LEGACY_RETRIEVAL.with_neighbours("next:two")
    with pytest.raises(ValueError, match="neighbours must be one of"):
        LEGACY_RETRIEVAL.with_neighbours("sideways:1")
    assert LEGACY_RETRIEVAL.with_neighbours("next").neighbours_spec == "next:1"
    assert LEGACY_RETRIEVAL.with_neighbours("none").neighbours_spec == "none:0"


def test_contexts_per_kind() -> None:
    text = "Ada Lind was born in 1970. She bakes bread.\n\nTwo years later, she moved to Dunmore."
    document = Document("ada.md", text, "ada.md", {"title": "Biographies"})
    chunks = [Chunk("c0", "ada.md", 0, text[:43], (1,), 0, 43, {"section": "Ada Lind"}),
              Chunk("c1", "ada.md", 1, text[45:], (2,), 45, len(text), {"section": "Ada Lind"})]
    assert chunk_contexts(document, chunks, "none") == ["", ""]
    assert chunk_contexts(document, chunks, "title") == ["Biographies Ada Lind", "Biographies Ada Lind"]
    assert chunk_contexts(document, chunks, "document_head") == [
        "Biographies Ada Lind", "Biographies Ada Lind Ada Lind was born in 1970."]
    assert chunk_contexts(document, chunks, "previous_tail") == [
        "Biographies Ada Lind", "Biographies Ada Lind She bakes bread."]
    plain = Document("ada.txt", text, "ada.txt")
    assert chunk_contexts(plain, chunks[:1], "document_head") == ["Ada Lind"]  # the chunk's own section
    assert embedding_text("She moved.", "") == "She moved."
    assert embedding_text("She moved.", "Ada Lind") == "Ada Lind\nShe moved."


@pytest.fixture(scope="module")
def world_index(tmp_path_factory: pytest.TempPathFactory):
    """A cross-chunk world (28 two-chunk documents) and 40 of its questions, written as a corpus, with the
    project's tokenizer and the test bed's chunker."""
    from transformers import AutoTokenizer

    from hypic_rag.demo.default_model import default_model_path
    from hypic_rag.runtime.model import tokenizer_digest
    from training.data.cross_chunk_qa import (cross_chunk_chunker, generate_cross_chunk_questions,
                                              generate_cross_chunk_world, write_cross_chunk_corpus)

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    world = generate_cross_chunk_world(912_000_000)
    questions = generate_cross_chunk_questions(world, 912_000_000, 40)
    root = tmp_path_factory.mktemp("cross-chunk")
    corpus = load_corpus(write_cross_chunk_corpus(world, questions, root / "world"))
    identity = ModelIdentity("test", "test", tokenizer_digest(tokenizer))
    return root, corpus, questions, cross_chunk_chunker(tokenizer), identity, SentenceEmbedder()


def _cross_recall(index: CorpusIndex, questions, neighbours: str | None = None) -> float:
    cross = [question for question in questions if question.kind == "cross"]
    found = index.search_many([question.text for question in cross], [8] * len(cross), hop_slots=2,
                              neighbours=neighbours)
    hit = [all((f"{question.gold_doc_ids[0]}.md", position) in {(h.chunk.doc_id, h.chunk.position) for h in hits}
               for position in question.needed_chunks) for question, hits in zip(cross, found)]
    return sum(hit) / len(hit)


def test_contextual_embeddings_and_neighbours_raise_cross_chunk_recall(world_index) -> None:
    root, corpus, questions, chunker, identity, embedder = world_index
    recall = {}
    for context in ("none", "document_head"):
        settings = RetrievalSettings(context)
        with CorpusIndex.open_for_update(root / f"index-{context}", embedder,
                                         IndexConfig(model=identity, chunker=chunker.config, retrieval=settings)) as index:
            index.ingest(corpus, chunker)
            recall[context, "none"] = _cross_recall(index, questions)
            recall[context, "next:1"] = _cross_recall(index, questions, "next:1")
            if context == "document_head":  # the cached tokens stay the chunk's own; only the vector changed
                stored = {chunk.chunk_id: chunk for chunk in index.docstore.iter_chunks()}
                plain = {(chunk.doc_id, chunk.position): chunk for document in corpus.documents
                         for chunk in chunker.chunk_document(document)}
                for chunk in stored.values():
                    assert chunk.token_ids == plain[chunk.doc_id, chunk.position].token_ids
                    assert chunk.text == plain[chunk.doc_id, chunk.position].text
                assert sum(chunk.chunk_id != plain[chunk.doc_id, chunk.position].chunk_id
                           for chunk in stored.values()) == len(corpus.documents)  # every second chunk re-keyed
    assert recall["none", "none"] < 0.75  # the dependent chunk does not name its subject
    assert recall["document_head", "none"] >= recall["none", "none"] + 0.25
    assert recall["none", "next:1"] >= recall["none", "none"] + 0.25
    assert recall["document_head", "next:1"] >= 0.95


def test_an_index_keeps_its_embedding_context_and_takes_another_expansion(world_index) -> None:
    root, corpus, _, chunker, identity, embedder = world_index
    directory = root / "index-kept"
    with CorpusIndex.open_for_update(directory, embedder, IndexConfig(model=identity, chunker=chunker.config)) as index:
        index.ingest(corpus, chunker)
        assert index.retrieval == DEFAULT_RETRIEVAL  # a new index records the default
    recorded = json.loads((directory / MANIFEST_FILE).read_text())["retrieval"]
    assert recorded == DEFAULT_RETRIEVAL.to_dict()
    with pytest.raises(IndexMismatchError, match="embedding context 'document_head', not 'none'.*--embedding-context"):
        CorpusIndex.open_for_update(directory, embedder, IndexConfig(model=identity, chunker=chunker.config,
                                                                     retrieval=RetrievalSettings("none")))
    with CorpusIndex.open(directory, embedder, neighbours="none") as index:  # per query: taken, not recorded
        assert index.retrieval == RetrievalSettings("document_head")
        with pytest.raises(IndexMismatchError, match="embedding context"):
            index.use_retrieval(RetrievalSettings("title", "next", 1))
        plain = index.search("Where did Ada move to?", k=8)
        expanded = index.search("Where did Ada move to?", k=8, neighbours="both:3")
        assert len(plain) == len(expanded) == 8
        assert not any(hit.neighbour_of for hit in plain)
        brought = [hit for hit in expanded if hit.neighbour_of]
        assert 0 < len(brought) <= 3
        for hit in brought:  # each next to a chunk of its document that was retrieved
            assert any(other.chunk.doc_id == hit.chunk.doc_id and other.chunk.chunk_id == hit.neighbour_of
                       and abs(other.chunk.position - hit.chunk.position) == 1 for other in expanded)
    assert json.loads((directory / MANIFEST_FILE).read_text())["retrieval"] == recorded
    # an index built before the settings were recorded reads as the chunk's text alone, no expansion
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    del manifest["retrieval"]
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))
    with CorpusIndex.open(directory, embedder) as index:
        assert index.retrieval == LEGACY_RETRIEVAL


def test_prompt_order_puts_a_brought_neighbour_right_after_its_chunk(world_index) -> None:
    """The pipeline's prompt order holds with the expansion: a document's chunks together, in document order, so a
    brought next chunk is marked as following the chunk it continues (what a chained policy reads)."""
    from hypic_rag.pipeline.answering import chunk_follows, prompt_order

    root, corpus, questions, chunker, identity, embedder = world_index
    with CorpusIndex.open_for_update(root / "index-order", embedder,
                                     IndexConfig(model=identity, chunker=chunker.config,
                                                 retrieval=RetrievalSettings("none", "next", 2))) as index:
        index.ingest(corpus, chunker)
        brought = 0
        for question in questions[:10]:
            hits = prompt_order(index.search(question.text, k=8, hop_slots=2))
            follows = chunk_follows(hits)
            for number, hit in enumerate(hits):
                group = [other.chunk.position for other in hits if other.chunk.doc_id == hit.chunk.doc_id]
                assert group == sorted(group)  # one document's chunks in document order
                if hit.neighbour_of is not None:
                    brought += 1
                    assert follows[number] and hits[number - 1].chunk.chunk_id == hit.neighbour_of
        assert brought >= 10  # every question's best hit (a first chunk) brought its second chunk
