"""One retrieval hop (`hypic_rag.retrieval.multi_hop`, `CorpusIndex.search(hop_slots=...)`): the pure helpers, and on
real indexes (shipped MiniLM, FAISS) of two synthetic held-out worlds, that two hop places find most two-hop gold
pairs (the direct search alone finds about a third) while every single-hop gold document stays retrieved."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from hypic_rag.retrieval.multi_hop import hop_queries, introduces_name, merge_hop_hits, novel_words, sentences_of


def test_sentences_and_novel_words() -> None:
    text = "Ada Lind works for Kestrel Works.  She lives in Orvath! Is she 40? yes"
    assert sentences_of(text) == ["Ada Lind works for Kestrel Works.", "She lives in Orvath!", "Is she 40?", "yes"]
    assert sentences_of("   ") == []
    assert novel_words("Ada Lind works for Kestrel Works.", "Where is the employer of ada lind based?") == "works for Kestrel Works."
    assert novel_words("Ada Lind.", "Who is Ada Lind?") == ""


def test_introduces_name() -> None:
    assert introduces_name("She works for Kestrel Works.", "Where is the employer of Ada Lind based?")
    assert not introduces_name("Ada Lind was born in 1970.", "When was Ada Lind born?")  # first word and asked names
    assert not introduces_name("She likes rowing.", "What does Ada Lind like?")


def test_hop_queries_put_name_sentences_first_then_the_closest() -> None:
    vectors = {"lives in Orvath.": np.array([0.6, 0.8]), "works for Kestrel Works.": np.array([0.9, 0.1]),
               "was born in 1970.": np.array([1.0, 0.0]), "She likes rowing.": np.array([0.0, 1.0])}

    def embed(texts):
        return np.stack([vectors[text] for text in texts])

    def texts(queries):
        return [text for text, _ in queries]

    passage = "Ada Lind was born in 1970. Ada Lind lives in Orvath. Ada Lind works for Kestrel Works. She likes rowing."
    question = "Who runs the employer of Ada Lind?"
    # name-bearing sentences first (closest to the question first), then the others by similarity
    ranked = hop_queries(question, np.array([1.0, 0.0]), passage, embed, 4)
    assert texts(ranked) == ["works for Kestrel Works.", "lives in Orvath.", "was born in 1970.", "She likes rowing."]
    assert all(np.array_equal(vector, vectors[text]) for text, vector in ranked)  # each query's own embedding
    assert texts(hop_queries(question, np.array([0.0, 1.0]), passage, embed, 2)) == ["lives in Orvath.", "works for Kestrel Works."]
    assert hop_queries(question, np.array([1.0, 0.0]), passage, embed, 0) == []
    assert hop_queries("Who is Ada Lind?", np.array([1.0, 0.0]), "", embed, 2) == []
    assert hop_queries("Who is Ada Lind?", np.array([1.0, 0.0]), "Ada Lind.", embed, 2) == []


@dataclass(frozen=True)
class Hit:
    name: str


def test_merge_keeps_direct_prefix_then_new_hop_hits_then_direct_tail() -> None:
    direct = [Hit(x) for x in "abcdef"]
    key = lambda hit: hit.name  # noqa: E731
    names = lambda hits: "".join(hit.name for hit in hits)  # noqa: E731
    hop = [Hit("a"), Hit("x"), Hit("y")]
    assert names(merge_hop_hits(direct, [hop], 4, 1, key)) == "abcx"
    assert names(merge_hop_hits(direct, [hop], 4, 2, key)) == "abxy"  # one list fills two places in turn
    # one new hit from each follow-up query, in query order
    assert names(merge_hop_hits(direct, [hop, [Hit("x"), Hit("z")]], 4, 2, key)) == "abxz"
    # a hop that finds nothing new leaves the direct hits
    assert names(merge_hop_hits(direct, [[Hit("a"), Hit("b")]], 4, 1, key)) == "abcd"
    assert names(merge_hop_hits(direct, [], 4, 2, key)) == "abcd"
    # the hop's hit already further down the direct list moves up, no duplicates
    assert names(merge_hop_hits(direct, [[Hit("e")]], 4, 2, key)) == "abec"
    assert names(merge_hop_hits(direct[:2], [[Hit("x")]], 4, 1, key)) == "abx"


@pytest.mark.slow
def test_hop_raises_two_hop_recall_on_real_indexes(tmp_path) -> None:
    from transformers import AutoTokenizer

    from hypic_rag.demo.default_model import default_model_path
    from training.heldout_retrieval import retrieved_cases
    from training.data.synthetic_qa import HELDOUT_SEED

    tokenizer = AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)

    def recall(hop_slots: int) -> tuple[float, float, int]:
        cases = list(retrieved_cases(HELDOUT_SEED, 100, tokenizer, num_chunks=8, two_hop_share=0.3,
                                     hop_slots=hop_slots, work_dir=tmp_path))
        assert all(len(case.chunk_texts) == 8 for case in cases)
        single = [case.gold_retrieved for case in cases if case.question.hops == 1]
        double = [case.gold_retrieved for case in cases if case.question.hops == 2]
        return sum(single) / len(single), sum(double) / len(double), len(double)

    single_direct, double_direct, count = recall(0)
    single_hop, double_hop, _ = recall(2)
    assert count >= 15
    assert single_hop == single_direct == 1.0
    assert double_hop >= double_direct + 0.3, (double_direct, double_hop)
    assert double_hop >= 0.85, double_hop


def test_the_shortlist_ranks_like_every_candidate() -> None:
    """Embedding only `hop_shortlist`'s candidates chooses the same follow-ups as embedding them all (random
    passages, names and vectors; the full ranking is the reference)."""
    from hypic_rag.retrieval.multi_hop import hop_candidates, hop_shortlist, rank_hop_candidates

    rng = np.random.default_rng(0)
    words = ["Orvath", "Kestrel", "Works", "rowing", "bread", "Mill", "river", "Vell", "north", "1970", "glass"]
    for _ in range(200):
        sentences = [" ".join(["She"] + list(rng.choice(words, size=int(rng.integers(1, 5))))) + "."
                     for _ in range(int(rng.integers(1, 7)))]
        question = "Who " + " ".join(rng.choice(words, size=2)) + "?"
        candidates = hop_candidates(question, " ".join(sentences))
        vectors = {follow: rng.normal(size=4) for _, follow in candidates}
        question_vector = rng.normal(size=4)
        for limit in range(5):
            every = rank_hop_candidates(question, question_vector, candidates,
                                        np.stack([vectors[f] for _, f in candidates]) if candidates else None, limit)
            shortlist = hop_shortlist(question, candidates, limit)
            chosen = rank_hop_candidates(question, question_vector, shortlist,
                                         np.stack([vectors[f] for _, f in shortlist]) if shortlist else None, limit)
            assert [text for text, _ in chosen] == [text for text, _ in every]
