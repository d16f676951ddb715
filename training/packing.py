"""Training examples in the query-time layout: prefix, k chunks, then several question/answer pairs.

Every segment is tokenized on its own and the ids concatenated, exactly as at query time (`hypic_rag.prompting.layout`).
One context carries many questions (dense supervision): the first pair is laid out exactly as a query, the later
pairs follow it. Loss weights: answer tokens (with the stop string) weigh `answer_weight`, every other token
`text_weight`, the prefix nothing.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from training.data.synthetic_qa import (
    RELATIONS_OF_KIND,
    Document,
    Question,
    World,
    generate_world,
    single_hop_question,
    two_hop_options,
    two_hop_question,
)
from hypic_rag.prompting.layout import DEFAULT_PROMPT_FORMAT, PromptFormat


@dataclass(frozen=True, slots=True)
class PackedExample:
    """token_ids [T] int64 and loss_weights [T] float32 (weight of predicting token t from tokens < t);
    chunk_spans: (start, length) of each retrieved-chunk segment (what the segment cache would encode alone)."""

    token_ids: torch.Tensor
    loss_weights: torch.Tensor
    num_answer_tokens: int
    chunk_spans: tuple[tuple[int, int], ...] = ()


class SegmentEncoder:
    """Tokenizes prompt segments on their own, with a memo (documents recur)."""

    def __init__(self, tokenizer, prompt_format: PromptFormat = DEFAULT_PROMPT_FORMAT) -> None:
        self.tokenizer = tokenizer
        self.prompt_format = prompt_format
        self._memo: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        ids = self._memo.get(text)
        if ids is None:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(self._memo) < 200_000:
                self._memo[text] = ids
        return ids

    def prefix(self) -> list[int]:
        return self.encode(self.prompt_format.prefix)

    def chunk(self, text: str) -> list[int]:
        return self.encode(self.prompt_format.chunk(text))

    def question(self, text: str) -> list[int]:
        return self.encode(self.prompt_format.question(text))

    def answer(self, text: str) -> list[int]:
        """The answer as the model generates it after the question segment: a leading space, the stop string."""
        return self.encode(" " + text + self.prompt_format.answer_stop)


def pack_example(
    encoder: SegmentEncoder,
    documents: Sequence[Document],
    questions: Sequence[Question],
    *,
    answer_weight: float = 1.0,
    text_weight: float = 0.2,
    recap: Sequence[Document] = (),
    recap_weight: float = 1.0,
) -> PackedExample:
    """Lay out prefix + chunks + (question, answer)* [+ recap chunks] and the per-token loss weights.

    recap: context documents repeated after the questions; every repeated token can be predicted by copying
    from the context, a dense signal that teaches the copy (induction) circuit that answering builds on.
    """
    ids: list[int] = list(encoder.prefix())
    weights: list[float] = [0.0] * len(ids)
    chunk_spans: list[tuple[int, int]] = []
    for document in documents:
        chunk_ids = encoder.chunk(document.text)
        chunk_spans.append((len(ids), len(chunk_ids)))
        ids += chunk_ids
        weights += [text_weight] * len(chunk_ids)
    num_answer_tokens = 0
    for question in questions:
        question_ids = encoder.question(question.text)
        answer_ids = encoder.answer(question.answer)
        ids += question_ids + answer_ids
        weights += [text_weight] * len(question_ids) + [answer_weight] * len(answer_ids)
        num_answer_tokens += len(answer_ids)
    for document in recap:
        chunk_ids = encoder.chunk(document.text)
        ids += chunk_ids
        weights += [recap_weight] * len(chunk_ids)
    return PackedExample(torch.tensor(ids, dtype=torch.long), torch.tensor(weights, dtype=torch.float32), num_answer_tokens,
                         tuple(chunk_spans))


@dataclass(frozen=True, slots=True)
class ContextSpec:
    """How one training context is drawn: `num_documents` chunks, up to `num_questions` questions."""

    num_documents: int
    num_questions: int
    two_hop_share: float = 0.25
    hard_negative_share: float = 0.0
    """Share of contexts whose other documents are the most confusable ones (see `confusable_first`) instead of
    random ones: what a retriever returns around a gold document."""


def sample_training_context(seed: int, spec: ContextSpec) -> tuple[list[Document], list[Question]]:
    """A context of `spec.num_documents` documents from the world of `seed` and questions answerable from it.

    About a third of the documents come as linked pairs (entity + the entity it links to) so that two-hop
    questions can be asked; the rest are random documents of the same world (distractors).
    """
    rng = random.Random(f"context-{seed}")
    world = generate_world(seed)
    chosen: list[str] = []
    linked = [entity for entity in world.entities if entity.links]
    for _ in range(max(1, spec.num_documents // 3)):
        entity = rng.choice(linked)
        for entity_id in (entity.entity_id, rng.choice(list(entity.links.values()))):
            if entity_id not in chosen and len(chosen) < spec.num_documents:
                chosen.append(entity_id)
    others = [entity.entity_id for entity in world.entities if entity.entity_id not in chosen]
    if spec.hard_negative_share > 0 and rng.random() < spec.hard_negative_share:
        chosen += confusable_first(world, chosen, others, rng)[: spec.num_documents - len(chosen)]
    else:
        chosen += rng.sample(others, spec.num_documents - len(chosen))
    rng.shuffle(chosen)
    documents = [world.document_of(entity_id) for entity_id in chosen]
    return documents, _questions_about(world, chosen, spec, rng, seed)


def confusable_first(world: World, chosen: Sequence[str], others: Sequence[str], rng: random.Random) -> list[str]:
    """`others` ordered most confusable with `chosen` first: same kind as the first chosen entity (same relations,
    same sentence templates), then any chosen kind, then attribute values shared with the chosen entities, with
    random tie-breaks. Retrieved neighbours of a question look like this; random distractors mostly do not."""
    anchor_kind = world.entity(chosen[0]).kind
    kinds = {world.entity(entity_id).kind for entity_id in chosen}
    values = {value for entity_id in chosen for value in world.entity(entity_id).attributes.values()}

    def score(entity_id: str) -> float:
        entity = world.entity(entity_id)
        shared = sum(value in values for value in entity.attributes.values())
        return 2.0 * (entity.kind == anchor_kind) + (entity.kind in kinds) + shared + 1.5 * rng.random()

    return sorted(others, key=score, reverse=True)


def _questions_about(world: World, entity_ids: list[str], spec: ContextSpec, rng: random.Random, seed: int) -> list[Question]:
    present = set(entity_ids)
    single = [(entity_id, relation) for entity_id in entity_ids for relation in RELATIONS_OF_KIND[world.entity(entity_id).kind]]
    double = [
        (entity_id, link, target)
        for entity_id in entity_ids
        for link, target in two_hop_options(world, world.entity(entity_id))
        if world.entity(entity_id).links[link] in present
    ]
    rng.shuffle(single)
    rng.shuffle(double)
    num_double = min(len(double), round(spec.num_questions * spec.two_hop_share))
    questions: list[Question] = []
    for index, (entity_id, link, target) in enumerate(double[:num_double]):
        questions.append(two_hop_question(world, world.entity(entity_id), link, target, rng, f"t{seed}-{index}"))
    for index, (entity_id, relation) in enumerate(single[: spec.num_questions - len(questions)]):
        questions.append(single_hop_question(world, world.entity(entity_id), relation, rng, f"t{seed}-s{index}"))
    rng.shuffle(questions)
    return questions


def collate(examples: Sequence[PackedExample], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest example. Returns token_ids [B, T] int64 and loss_weights [B, T] float32 (0 on
    padding). Right padding needs no attention mask: causal layers never see the padding of earlier tokens."""
    length = max(example.token_ids.numel() for example in examples)
    token_ids = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    weights = torch.zeros((len(examples), length), dtype=torch.float32)
    for row, example in enumerate(examples):
        token_ids[row, : example.token_ids.numel()] = example.token_ids
        weights[row, : example.loss_weights.numel()] = example.loss_weights
    return token_ids, weights
