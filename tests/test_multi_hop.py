"""One retrieval hop (`hypic_rag.retrieval.multi_hop`, `CorpusIndex.search(hop_slots=...)`): the pure helpers, and on
real indexes (shipped MiniLM, FAISS) of two synthetic held-out worlds, that the hop finds more two-hop gold pairs
while every single-hop gold document stays retrieved."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from hypic_rag.retrieval.multi_hop import hop_query, merge_hop_hits, novel_words, sentences_of


def test_sentences_and_novel_words() -> None:
    text = "Ada Lind works for Kestrel Works.  She lives in Orvath! Is she 40? yes"
    assert sentences_of(text) == ["Ada Lind works for Kestrel Works.", "She lives in Orvath!", "Is she 40?", "yes"]
    assert sentences_of("   ") == []
    assert novel_words("Ada Lind works for Kestrel Works.", "Where is the employer of ada lind based?") == "works for Kestrel Works."
    assert novel_words("Ada Lind.", "Who is Ada Lind?") == ""


def test_hop_query_picks_the_sentence_closest_to_the_question() -> None:
    sentences = {"Ada Lind lives in Orvath.": np.array([0.6, 0.8]), "Ada Lind works for Kestrel Works.": np.array([0.9, 0.1])}

    def embed(texts):
        return np.stack([sentences[text] for text in texts])

    question_vector = np.array([1.0, 0.0])
    passage = "Ada Lind lives in Orvath. Ada Lind works for Kestrel Works."
    assert hop_query("Who runs the employer of Ada Lind?", question_vector, passage, embed) == "works for Kestrel Works."
    # a question closer to the other sentence follows that one
    assert hop_query("Where does Ada Lind live?", np.array([0.0, 1.0]), passage, embed) == "lives in Orvath."
    assert hop_query("Who is Ada Lind?", question_vector, "", embed) is None


@dataclass(frozen=True)
class Hit:
    name: str


def test_merge_keeps_direct_prefix_then_new_hop_hits_then_direct_tail() -> None:
    direct = [Hit(x) for x in "abcdef"]
    key = lambda hit: hit.name  # noqa: E731
    names = lambda hits: "".join(hit.name for hit in hits)  # noqa: E731
    assert names(merge_hop_hits(direct, [Hit("a"), Hit("x"), Hit("y")], 4, 1, key)) == "abcx"
    assert names(merge_hop_hits(direct, [Hit("a"), Hit("x"), Hit("y")], 4, 2, key)) == "abxy"
    # a hop that finds nothing new leaves the direct hits
    assert names(merge_hop_hits(direct, [Hit("a"), Hit("b")], 4, 1, key)) == "abcd"
    # the hop's hit already further down the direct list moves up, no duplicates
    assert names(merge_hop_hits(direct, [Hit("e")], 4, 2, key)) == "abec"
    assert names(merge_hop_hits(direct[:2], [Hit("x")], 4, 1, key)) == "abx"


@pytest.mark.slow
def test_hop_raises_two_hop_recall_on_real_indexes(tmp_path) -> None:
    from transformers import AutoTokenizer

    from hypic_rag.default_model import default_model_path
    from hypic_rag.training.heldout_retrieval import retrieved_cases
    from hypic_rag.training.trainer import HELDOUT_SEED

    tokenizer = AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)

    def recall(hop_slots: int) -> tuple[float, float, int]:
        cases = list(retrieved_cases(HELDOUT_SEED, 100, tokenizer, num_chunks=8, two_hop_share=0.3,
                                     hop_slots=hop_slots, work_dir=tmp_path))
        assert all(len(case.chunk_texts) == 8 for case in cases)
        single = [case.gold_retrieved for case in cases if case.question.hops == 1]
        double = [case.gold_retrieved for case in cases if case.question.hops == 2]
        return sum(single) / len(single), sum(double) / len(double), len(double)

    single_direct, double_direct, count = recall(0)
    single_hop, double_hop, _ = recall(1)
    assert count >= 15
    assert single_hop == single_direct == 1.0
    assert double_hop >= double_direct + 0.15, (double_direct, double_hop)
