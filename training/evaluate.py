"""Exact-match evaluation of a causal LM on the synthetic QA task with transformers' own forward (mode `full`).

The prompt is laid out segment by segment (`SegmentEncoder`), then greedy decoding with the model's cache runs
until the answer stop string or end of sequence.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from training.data.synthetic_qa import Document, Question, World, distractor_context, generate_questions, generate_world
from training.packing import SegmentEncoder


def prompt_ids(encoder: SegmentEncoder, documents: Sequence[Document], question_text: str) -> list[int]:
    """prefix + one segment per document + the question segment, each tokenized on its own."""
    ids = list(encoder.prefix())
    for document in documents:
        ids += encoder.chunk(document.text)
    return ids + encoder.question(question_text)


@torch.no_grad()
def greedy_answer(model, encoder: SegmentEncoder, input_ids: Sequence[int], max_new_tokens: int = 16) -> str:
    """Greedy continuation of `input_ids` up to the stop string; returns the answer text, stripped."""
    stop = encoder.prompt_format.answer_stop
    eos_id = encoder.tokenizer.eos_token_id
    tokens = torch.tensor([list(input_ids)], dtype=torch.long)
    output = model(input_ids=tokens, use_cache=True)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        next_id = int(output.logits[0, -1].argmax())
        if next_id == eos_id:
            break
        generated.append(next_id)
        text = encoder.tokenizer.decode(generated)
        if stop in text:
            return text.split(stop)[0].strip()
        output = model(
            input_ids=torch.tensor([[next_id]]), cache=output.past_key_values, use_cache=True
        )
    return encoder.tokenizer.decode(generated).split(stop)[0].strip()


@dataclass(frozen=True, slots=True)
class EvalItem:
    """One evaluated question: the gold and predicted answers."""

    question: Question
    prediction: str

    @property
    def exact(self) -> bool:
        return self.prediction == self.question.answer

    @property
    def final_exact(self) -> bool:
        """Exact match of the final answer only (the part after the two-hop bridge)."""
        return self.prediction.split("->")[-1].strip() == self.question.final_answer


def heldout_cases(
    seed: int, num_questions: int, num_chunks: int = 8, two_hop_share: float = 0.2, questions_per_world: int = 50
) -> Iterable[tuple[World, Question, list[Document]]]:
    """Held-out (world, question, context) triples: worlds of seeds `seed`, `seed + 1`, ...; each context is
    the gold document(s) plus random distractor documents of the same world (`num_chunks` in all)."""
    produced = 0
    world_seed = seed
    while produced < num_questions:
        world = generate_world(world_seed)
        rng = random.Random(f"heldout-{world_seed}")
        count = min(questions_per_world, num_questions - produced)
        for question in generate_questions(world, world_seed, count, two_hop_share=two_hop_share):
            yield world, question, distractor_context(world, question, num_chunks, rng)
            produced += 1
        world_seed += 1


def summarize(items: Sequence[EvalItem]) -> dict[str, float | int]:
    """EM overall, on single-hop and two-hop questions, and final-answer EM on two-hop ones."""
    def share(selected: list[EvalItem], attribute: str = "exact") -> float:
        return sum(getattr(item, attribute) for item in selected) / len(selected) if selected else float("nan")

    single = [item for item in items if item.question.hops == 1]
    double = [item for item in items if item.question.hops == 2]
    return {
        "num_questions": len(items),
        "exact_match": share(list(items)),
        "single_hop_exact_match": share(single),
        "num_two_hop": len(double),
        "two_hop_exact_match": share(double),
        "two_hop_final_answer_exact_match": share(double, "final_exact"),
    }
