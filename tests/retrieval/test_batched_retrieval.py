"""Batched retrieval (`CorpusIndex.search_many`, `RagPipeline.prepare_many`): questions embedded in one call and
searched together get exactly what each gets alone (chunks, order, hop queries, request token ids), on a real index
(the shipped MiniLM embedder, FAISS), the retrieval hop included; a bad question fails alone."""

from __future__ import annotations

import numpy as np
import pytest

from hypic_rag.pipeline.answering import PipelineError, Question, RagPipeline
from kits.corpora import SMALL_CORPUS_QUESTIONS

QUESTIONS = [*SMALL_CORPUS_QUESTIONS.values(), "Where does the glassblower live, and who mends bicycles?",
             "What is sold at the Saturday market?"]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, copy_tiny_index) -> RagPipeline:
    opened = RagPipeline.open(copy_tiny_index(tmp_path_factory.mktemp("batched") / "index"), device="cpu")
    yield opened
    opened.close()


def hits_of(hits) -> list[tuple[str, str | None]]:
    return [(hit.chunk.chunk_id, hit.hop_query) for hit in hits]


@pytest.mark.parametrize("hop_slots", [0, 2])
def test_search_many_finds_what_each_query_finds_alone(pipeline: RagPipeline, hop_slots: int) -> None:
    index = pipeline.index
    ks = [4, 3, 4, 2, 5, 4, 4, 1]
    together = index.search_many(QUESTIONS, ks, hop_slots=hop_slots)
    assert len(together) == len(QUESTIONS)
    hopped = 0
    for question, k, hits in zip(QUESTIONS, ks, together):
        alone = index.search(question, k, hop_slots=hop_slots)
        assert hits_of(hits) == hits_of(alone)
        np.testing.assert_allclose([hit.score for hit in hits], [hit.score for hit in alone], atol=1e-5)
        hopped += sum(hit.hop_query is not None for hit in hits)
    assert (hopped > 0) == (hop_slots > 0)  # the hop did run in the batch (and only when asked)
    assert index.search_many([], [], hop_slots=hop_slots) == []
    with pytest.raises(ValueError, match="values of k"):
        index.search_many(QUESTIONS[:2], [4], hop_slots=hop_slots)


def test_prepare_many_lays_out_what_prepare_does_and_fails_bad_questions_alone(pipeline: RagPipeline) -> None:
    asked = [Question(text, top_k=4, mode=mode) for text, mode in zip(QUESTIONS, ["hypic", "full"] * 4)]
    asked.insert(3, Question("   ", top_k=4))
    asked.insert(5, Question("Who?", top_k=4, mode="no-such-mode"))
    prepared = pipeline.prepare_many(asked)
    assert isinstance(prepared[3], PipelineError) and "empty" in str(prepared[3])
    assert isinstance(prepared[5], ValueError) and "no-such-mode" in str(prepared[5])
    for question, batched in zip(asked, prepared):
        if isinstance(batched, Exception):
            continue
        alone = pipeline.prepare(question.text, top_k=question.top_k, mode=question.mode)
        assert batched.request.all_ids() == alone.request.all_ids()
        assert batched.request.chunk_ranks == alone.request.chunk_ranks
        assert [source.chunk_id for source in batched.sources] == [source.chunk_id for source in alone.sources]
        assert batched.mode == question.mode and batched.policy == alone.policy
