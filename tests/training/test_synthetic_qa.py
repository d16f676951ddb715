"""The synthetic QA generator: deterministic, answerable, varied, and packed in the query-time layout."""

from __future__ import annotations

import random

import pytest

from training.data.name_pools import name_pools
from training.data.synthetic_qa import (
    TWO_HOP_SEPARATOR,
    distractor_context,
    generate_questions,
    generate_world,
)


def test_same_seed_same_world_and_questions() -> None:
    first, second = generate_world(7), generate_world(7)
    assert first.documents == second.documents
    assert generate_questions(first, 3, 30) == generate_questions(second, 3, 30)
    assert generate_world(8).documents != first.documents


def test_name_pools_are_disjoint_and_fixed() -> None:
    names = name_pools().all_names()
    assert len(names) == len(set(names))
    assert name_pools().first_names[0] == "Stasul"  # changing the pool would change the shipped tokenizer


def test_single_hop_answer_is_in_its_gold_document_only_among_context() -> None:
    world = generate_world(3)
    documents = {document.doc_id: document for document in world.documents}
    for question in generate_questions(world, 0, 60, two_hop_share=0.0):
        assert question.hops == 1 and len(question.gold_doc_ids) == 1
        assert question.answer in documents[question.gold_doc_ids[0]].text


def test_two_hop_questions_need_two_documents() -> None:
    world = generate_world(4)
    documents = {document.doc_id: document for document in world.documents}
    questions = [q for q in generate_questions(world, 0, 80, two_hop_share=1.0) if q.hops == 2]
    assert len(questions) > 40
    for question in questions:
        bridge, final = question.answer.split(TWO_HOP_SEPARATOR)
        first, second = (documents[doc_id].text for doc_id in question.gold_doc_ids)
        assert bridge in first and final in second
        assert bridge not in question.text


def test_share_of_two_hop_questions_follows_the_setting() -> None:
    world = generate_world(5)
    questions = generate_questions(world, 1, 200, two_hop_share=0.3)
    share = sum(question.hops == 2 for question in questions) / len(questions)
    assert 0.15 < share < 0.4


def test_documents_vary_their_layout() -> None:
    world = generate_world(6)
    people = [document.text for entity, document in zip(world.entities, world.documents) if entity.kind == "person"]
    first_words = {text.split(".")[0].split(" ", 2)[-1].split(" ")[0] for text in people}
    assert len(first_words) >= 5  # first sentences do not all use the same relation template
    assert any(" He " in text or " She " in text for text in people)  # pronouns after the first sentence


def test_documents_stay_short() -> None:
    world = generate_world(9)
    assert max(len(document.text.split()) for document in world.documents) < 80


@pytest.mark.parametrize("num_chunks", [4, 8])
def test_distractor_context_holds_gold_documents(num_chunks: int) -> None:
    world = generate_world(2)
    question = generate_questions(world, 0, 5, two_hop_share=1.0)[0]
    context = distractor_context(world, question, num_chunks, random.Random(0))
    assert len(context) == num_chunks
    assert set(question.gold_doc_ids) <= {document.doc_id for document in context}
