"""The cross-chunk test bed (issue 42, `training/data/cross_chunk_qa.py`): its dependencies are real on the
project's own chunker (the fact a cross-chunk question needs sits in the second chunk, which never names its
subject), the check of that can fail, and the prompt lays out the chunks of one document in document order."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from hypic_rag.pipeline.answering import RagPipeline, chunk_follows, prompt_order
from hypic_rag.retrieval.loading import Document
from training.data.cross_chunk_qa import (
    CROSS_CHUNK_TOKENS,
    check_dependencies,
    cross_chunk_chunker,
    generate_cross_chunk_questions,
    generate_cross_chunk_world,
    sample_cross_chunk_context,
)
from evals.recompute_policies import STAGE3_MODEL

WORLDS = (910_000_000, 12_345)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(STAGE3_MODEL)


def chunk_texts(chunker, document) -> list[str]:
    return [chunk.text for chunk in chunker.chunk_document(Document(document.doc_id, document.text, document.doc_id))]


@pytest.mark.parametrize("seed", WORLDS)
def test_the_second_chunk_holds_the_fact_and_never_the_name(tokenizer, seed: int) -> None:
    world = generate_cross_chunk_world(seed)
    questions = generate_cross_chunk_questions(world, seed, 50)
    chunker = cross_chunk_chunker(tokenizer)
    kinds = {question.kind for question in questions}
    assert kinds == {"single", "cross"}
    for document in world.documents:
        texts = chunk_texts(chunker, document)
        assert len(texts) == 2  # the document runs to two chunks at the index's chunk size
        assert check_dependencies(document, texts, questions) == []
        # the claims, spelled out: the name only in chunk 0, every cross-chunk answer only in chunk 1
        assert document.name in texts[0] and document.name not in texts[1]
        for question in questions:
            if question.gold_doc_ids == (document.doc_id,) and question.kind == "cross":
                sentence = document.facts[question.relations[0]][1]
                assert sentence in texts[1] and sentence not in texts[0]
                assert question.needed_chunks == (0, 1)


def test_the_dependency_check_fails_on_broken_documents(tokenizer) -> None:
    world = generate_cross_chunk_world(WORLDS[0])
    questions = generate_cross_chunk_questions(world, WORLDS[0], 50)
    chunker = cross_chunk_chunker(tokenizer)
    document = next(document for document in world.documents
                    if any(question.gold_doc_ids == (document.doc_id,) and question.kind == "cross"
                           for question in questions))
    texts = chunk_texts(chunker, document)
    # the dependent chunk repeats the name
    named = [texts[0], f"{document.name} is mentioned again. {texts[1]}"]
    assert any("repeats the name" in problem for problem in check_dependencies(document, named, questions))
    # a chunker with room for both paragraphs keeps them in one chunk: the cross-chunk fact is not in chunk 1
    merged = [" ".join(texts)]
    assert any("not in chunk 1" in problem for problem in check_dependencies(document, merged, questions))
    # a question that claims to be single-chunk but needs the second chunk
    cross = next(question for question in questions
                 if question.gold_doc_ids == (document.doc_id,) and question.kind == "cross")
    mislabelled = dataclasses.replace(cross, kind="single", needed_chunks=(0,))
    assert any("single-chunk, but" in problem for problem in check_dependencies(document, texts, [mislabelled]))


def test_training_contexts_ask_only_what_their_chunks_hold() -> None:
    chunks, questions = sample_cross_chunk_context(3, 5, 16)
    held = {chunk.doc_id for chunk in chunks}
    assert questions and any(question.kind == "cross" for question in questions)
    for question in questions:
        assert all(f"{question.gold_doc_ids[0]}#{position}" in held for position in question.needed_chunks)
    for chunk in chunks:  # a document's chunks are together and in document order
        doc_id, position = chunk.doc_id.split("#")
        if position == "1" and f"{doc_id}#0" in held:
            assert [c.doc_id for c in chunks].index(f"{doc_id}#0") + 1 == [c.doc_id for c in chunks].index(chunk.doc_id)


def hit(doc_id: str, position: int, hop: bool = False) -> SimpleNamespace:
    return SimpleNamespace(chunk=SimpleNamespace(doc_id=doc_id, position=position), hop_query="q" if hop else None)


def test_prompt_order_puts_a_documents_chunks_together_in_document_order() -> None:
    hits = [hit("a", 2), hit("b", 0), hit("a", 0), hit("c", 1), hit("b", 3, hop=True), hit("c", 0, hop=True)]
    ordered = [(h.chunk.doc_id, h.chunk.position) for h in prompt_order(hits)]
    assert ordered == [("a", 0), ("a", 2), ("b", 0), ("b", 3), ("c", 0), ("c", 1)]
    single = [hit("x", 0), hit("y", 0), hit("z", 0)]
    assert prompt_order(single) == single  # one chunk per document: retrieval order kept


def test_the_pipeline_lays_out_retrieved_chunks_in_document_order(tmp_path: Path, tiny_model: Path) -> None:
    from kits.corpora import build_index

    documents = {
        f"doc{number}.md": "\n\n".join(
            f"{name} paragraph {part} says the {colour} lamp stands by the {place}. It has more to say here."
            for part in range(3))
        for number, (name, colour, place) in enumerate([("Ada", "red", "door"), ("Bo", "blue", "window"),
                                                        ("Cy", "green", "stairs")])
    }
    index_dir = build_index(tmp_path / "index", tiny_model, documents, chunk_tokens=CROSS_CHUNK_TOKENS)
    with RagPipeline.open(index_dir, device="cpu", recompute_policy="seam@0+chained") as pipeline:
        reordered = followed = 0
        for question in ("Where does the green lamp stand?", "What does paragraph 2 say about the blue lamp?",
                         "Which lamp stands by the door?"):
            hits = pipeline.index.search(question, 6, hop_slots=pipeline.hop_slots)
            prepared = pipeline.prepare(question, top_k=6)
            laid_out = prompt_order(hits)
            assert prepared.request.chunk_ids == [list(h.chunk.token_ids) for h in laid_out]
            places = [(h.chunk.doc_id, h.chunk.position) for h in laid_out]
            for doc_id in {doc for doc, _ in places}:
                numbers = [n for n, (doc, _) in enumerate(places) if doc == doc_id]
                assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))  # together
                assert [places[n][1] for n in numbers] == sorted(places[n][1] for n in numbers)  # in order
            reordered += [h.chunk.chunk_id for h in hits] != [h.chunk.chunk_id for h in laid_out]
            follows = chunk_follows(laid_out)
            assert prepared.request.chunk_follows == (follows if any(follows) else [])
            followed += any(follows)
        assert reordered > 0  # retrieval order alone would not have been document order
        assert followed > 0
        answer = pipeline.answer("Where does the green lamp stand?", top_k=6)  # ask's path under a chained policy
        assert answer.recompute_policy == "seam@0+chained" and answer.usage


def case(kind: str, retrieved: bool) -> SimpleNamespace:
    return SimpleNamespace(question=SimpleNamespace(kind=kind, needed_chunks=(0, 1) if kind == "cross" else (0,)),
                           needed_retrieved=retrieved)


def test_the_evaluation_reports_recall_and_em_per_question_subset() -> None:
    from evals.recompute_policies import main, needed_recall, subset_rows, subsets_markdown

    cases = [case("cross", True), case("cross", False), case("single", True), case("single", True)]
    recall = needed_recall(cases)
    assert recall == {"all": 0.75, "cross": 0.5, "single": 1.0}
    subsets = subset_rows(cases, [True, False, True, False], [True, True, True, True])
    assert subsets["cross"] == {"questions": 2, "exact_match": 0.5, "em_minus_full": -0.5}
    assert subsets["needed_retrieved"]["questions"] == 3
    assert subsets["cross_needed_retrieved"] == {"questions": 1, "exact_match": 1.0, "em_minus_full": 0.0}
    text = subsets_markdown([{"variant": "seam@8", "subsets": subsets}], recall)
    assert "cross 50.0%" in text and "| seam@8 | 50.0% (-50.0) |" in text
    # the default test bed's cases have no subsets: its reports keep their layout
    assert subset_rows([SimpleNamespace(question=SimpleNamespace(hops=1))], [True], [True]) == {}
    with pytest.raises(SystemExit):
        main(["--test-bed", "no-such-bed"])


def test_index_bytes_count_the_entries_each_kind_of_index_stores(tmp_path: Path, tiny_model: Path) -> None:
    """`precompute` encodes the entries of the policy an index is built for (a chained index: the anchored entry of
    every chunk and the chained entry of every chunk that follows its document's previous one), and `index_bytes`
    counts what each index's LMDB store holds; a chained request then reads the chained index without a miss and
    the plain index with misses (the check can fail)."""
    from evals.recompute_policies import index_bytes, stored_entries
    from hypic_rag.retrieval.corpus_index import DEFAULT_CACHE_DIR
    from kits.corpora import write_corpus

    documents = {
        f"doc{number}.md": "\n\n".join(
            f"{name} paragraph {part} says the {colour} lamp stands by the {place}. It has more to say here."
            for part in range(3))
        for number, (name, colour, place) in enumerate([("Ada", "red", "door"), ("Bo", "blue", "window")])
    }
    corpus = write_corpus(tmp_path / "corpus", documents)
    kinds = index_bytes(tiny_model, corpus, tmp_path, chunk_tokens=CROSS_CHUNK_TOKENS, seam_tokens=4)["kinds"]
    chunks = kinds["plain"]["chunks"]
    with RagPipeline.open(tmp_path / "index-chained", device="cpu", recompute_policy="seam+chained") as pipeline:
        stored = list(pipeline.index.docstore.iter_chunks())
    pairs = [(before, chunk) for before, chunk in zip(stored, stored[1:])
             if chunk.doc_id == before.doc_id and chunk.position == before.position + 1]
    distinct = {tuple(chunk.token_ids) for chunk in stored}  # a chunk repeated in two documents is stored once
    distinct_pairs = {(tuple(before.token_ids), tuple(chunk.token_ids)) for before, chunk in pairs}
    assert chunks == len(stored) and len(distinct_pairs) >= 2  # documents of several chunks
    assert kinds["plain"]["entries"] == kinds["anchored"]["entries"] == len(distinct) + 1  # every chunk, the prefix
    assert kinds["chained"]["entries"] == len(distinct) + 1 + len(distinct_pairs)
    assert kinds["chained"]["chained_entries"] == len(distinct_pairs)
    for kind, row in kinds.items():
        held = stored_entries(tmp_path / f"index-{kind}" / DEFAULT_CACHE_DIR)
        assert row["stored_bytes"] == sum(held.values()) == row["planned_bytes"]
        assert row["bytes_per_chunk"] == row["stored_bytes"] / chunks
    assert kinds["plain"]["stored_bytes"] < kinds["anchored"]["stored_bytes"] < kinds["chained"]["stored_bytes"]
    assert kinds["chained"]["stored_bytes"] == kinds["anchored"]["stored_bytes"] + kinds["chained"]["chained_bytes"]
    misses = {}
    for kind in ("chained", "plain"):
        with RagPipeline.open(tmp_path / f"index-{kind}", device="cpu", recompute_policy="seam+chained") as pipeline:
            before, chunk = pairs[0]
            request = pipeline.request_for("Where does the lamp stand?",
                                           [list(before.token_ids), list(chunk.token_ids)], follows=[False, True])
            misses[kind] = pipeline.engine.prefill(request, "hypic").stats.cache_misses
    assert misses == {"chained": 0, "plain": 2}
    # the product's path: calibration records a chained policy, and precompute run again encodes what it reads
    from hypic_rag.pipeline.precompute import build_index
    from hypic_rag.retrieval.corpus_index import record_recompute_policy

    record_recompute_policy(tmp_path / "index-plain", {"policy": "seam+chained", "kl_target": 0.1, "met": True})
    build_index(corpus, tmp_path / "index-plain", model=tiny_model, chunk_tokens=CROSS_CHUNK_TOKENS, seam_tokens=4,
                device="cpu", show_progress=False)
    rebuilt = stored_entries(tmp_path / "index-plain" / DEFAULT_CACHE_DIR)
    assert set(rebuilt) >= set(stored_entries(tmp_path / "index-chained" / DEFAULT_CACHE_DIR))
    assert len(rebuilt) == kinds["plain"]["entries"] + kinds["chained"]["entries"] - 1  # the prefix's is shared
