"""Worlds whose entity documents run to two chunks, the second depending on the first (issue 42's test bed).

Each entity of a `synthetic_qa` world (smaller worlds, same entities and attributes) is written as two paragraphs,
which the index's chunker (`CROSS_CHUNK_CHUNKER`) cuts into two chunks:

- chunk 0 names the entity (its first sentence, in full) and states some of its facts, among them a *base* fact
  that the second chunk refers back to (a person's birth year, a company's first product, a city's mayor, a
  product's launch year);
- chunk 1 never names it: its subject is a pronoun or a definite description ("She", "The company", "The city",
  "The product", "The baker"), and it states the other facts and one *relative* fact stated against the base
  ("Two years later, she moved to Dunmore.", "Its second product was the Vela 3.", "Four years later, the city
  elected Ana Moss as its next mayor.", "Two years later, a second version came out in green.").

Questions name the entity and ask one fact. A fact of chunk 0 is a *single-chunk* question (the control); a fact of
chunk 1 is a *cross-chunk* question: its answer sits in chunk 1, whose text cannot say which entity it is about,
so a reader needs chunk 0 right before it. `CrossChunkQuestion.needed_chunks` lists the chunk positions (within the
gold document) a question needs. `check_dependencies` verifies on the real chunker's chunks that these dependencies
hold (tests/evals/test_cross_chunk_test_bed.py).

Everything is a pure function of the seed, like `synthetic_qa`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from training.data.name_pools import COLOURS, name_pools
from training.data.synthetic_qa import (
    QUESTION_TEMPLATES,
    RELATIONS_OF_KIND,
    SENTENCE_TEMPLATES,
    Document,
    Entity,
    Question,
    _with_article,
    generate_world,
)

CROSS_CHUNK_TOKENS = 48
"""The index's chunk size (tokens of a formatted chunk segment) for these worlds: each paragraph fits, two do not."""
CROSS_CHUNK_PARAGRAPH_FILL = 0.25
"""The chunker closes a chunk at the first paragraph end once it holds this share of `CROSS_CHUNK_TOKENS`."""

CROSS_CHUNK_HELDOUT_SEED = 910_000_000
"""Default world of the cross-chunk evaluation (held out: never used in training, < 40,000,000, or validation)."""

BASE_RELATION = {"person": "born_year", "organisation": "first_product", "place": "mayor", "product": "launch_year"}
"""The chunk-0 fact each kind's relative fact refers back to."""
RELATIVE_RELATION = {"person": "moved_to", "organisation": "second_product", "place": "next_mayor",
                     "product": "second_colour"}
"""The chunk-1 fact stated relative to the base fact."""

REFERENCES: dict[str, tuple[str, ...]] = {
    "organisation": ("It", "The company", "The firm"),
    "place": ("It", "The city", "The town"),
    "product": ("It", "The product"),
}
"""Subjects of chunk-1 sentences (a person's: the pronoun or "The <profession>")."""

NUMBER_WORDS = ("Two", "Three", "Four", "Five", "Six")

EXTRA_SENTENCES: dict[str, tuple[str, ...]] = {
    "first_product": ("{S} launched its first product, the {v}.", "{S} sold its first product, the {v}."),
    "second_product": ("Its second product was the {v}.", "{N} years later came its second product, the {v}."),
    "moved_to": ("{N} years later, {s} moved to {v}.", "{N} years after that, {s} moved to {v}."),
    "next_mayor": ("{N} years later, {s} elected {v} as its next mayor.", "{N} years later, {v} became its next mayor."),
    "second_colour": ("{N} years later, a second version came out in {v}.",
                      "{N} years later, {s} got a second version in {v}."),
}
"""Sentence templates of the base and relative relations that `synthetic_qa` does not have: {S} the subject
(sentence start), {s} the subject inside a sentence, {v} the value, {N} a number word."""

EXTRA_QUESTIONS: dict[str, tuple[str, ...]] = {
    "first_product": ("What was the first product of {X}?",),
    "second_product": ("What was the second product of {X}?", "Which product did {X} launch second?"),
    "moved_to": ("Where did {X} move to?", "To which city did {X} move?"),
    "next_mayor": ("Who was the next mayor of {X}?", "Who became the next mayor of {X}?"),
    "second_colour": ("What colour is the second version of {X}?", "In which colour did the second version of {X} come out?"),
}


@dataclass(frozen=True, slots=True)
class CrossChunkDocument:
    """One entity's document: `paragraphs[j]` is the text of chunk j; `facts[relation]` = (chunk position, the
    sentence stating it, the value)."""

    doc_id: str
    entity_id: str
    name: str
    paragraphs: tuple[str, ...]
    facts: dict[str, tuple[int, str, str]]

    @property
    def text(self) -> str:
        """The document as written to disk: paragraphs separated by a blank line."""
        return "\n\n".join(self.paragraphs)


@dataclass(frozen=True, slots=True)
class CrossChunkQuestion(Question):
    """A `Question` about one entity's fact; `needed_chunks`: the chunk positions of the gold document it needs
    (`(0,)` single-chunk, `(0, 1)` cross-chunk); `kind`: "single" or "cross"."""

    needed_chunks: tuple[int, ...] = (0,)
    kind: str = "single"


@dataclass(frozen=True, slots=True)
class CrossChunkWorld:
    """The entities of one seed and their two-chunk documents (`documents[i]` describes `entities[i]`)."""

    seed: int
    entities: tuple[Entity, ...]
    documents: tuple[CrossChunkDocument, ...]

    def document_of(self, entity_id: str) -> CrossChunkDocument:
        return next(document for document in self.documents if document.entity_id == entity_id)


def _reference(entity: Entity, rng: random.Random) -> str:
    """A chunk-1 subject for `entity`: a pronoun or a definite description, never its name."""
    if entity.kind == "person":
        return rng.choice((entity.pronoun, entity.pronoun, f"The {entity.attributes['profession']}"))
    return rng.choice(REFERENCES[entity.kind])


def _inner(subject: str) -> str:
    """A subject as it reads inside a sentence ("The company" -> "the company", "She" -> "she")."""
    return subject[0].lower() + subject[1:]


def _sentence(relation: str, subject: str, value: str, rng: random.Random) -> str:
    if relation in EXTRA_SENTENCES:
        text = rng.choice(EXTRA_SENTENCES[relation]).format(S=subject, s=_inner(subject), v=value,
                                                             N=rng.choice(NUMBER_WORDS))
    else:
        text = rng.choice(SENTENCE_TEMPLATES[relation]).format(S=subject, v=value, a_v=_with_article(value))
    return text[0].upper() + text[1:]


def _extra_values(entity: Entity, rng: random.Random, pools, place_names: Sequence[str]) -> dict[str, str]:
    """The base and relative facts `synthetic_qa` entities lack."""
    if entity.kind == "organisation":
        first, second = rng.sample(pools.product_stems, 2)
        return {"first_product": f"{first} {rng.randint(2, 9)}", "second_product": f"{second} {rng.randint(2, 9)}"}
    if entity.kind == "person":
        return {"moved_to": rng.choice([name for name in place_names if name != entity.attributes["lives_in"]])}
    if entity.kind == "place":
        return {"next_mayor": f"{rng.choice(pools.first_names)} {rng.choice(pools.last_names)}"}
    return {"second_colour": rng.choice([colour for colour in COLOURS if colour != entity.attributes["colour"]])}


def write_cross_chunk_document(entity: Entity, doc_id: str, rng: random.Random, pools,
                               place_names: Sequence[str]) -> CrossChunkDocument:
    """Two paragraphs about `entity` (see the module docstring): chunk 0 opens with its name, chunk 1 never names it."""
    values = {**entity.attributes, **_extra_values(entity, rng, pools, place_names)}
    base, relative = BASE_RELATION[entity.kind], RELATIVE_RELATION[entity.kind]
    others = [relation for relation in RELATIONS_OF_KIND[entity.kind] if relation != base]
    rng.shuffle(others)
    first_count = 2 if entity.kind == "person" else rng.randint(1, 2)
    first = [base] + others[:first_count]
    rng.shuffle(first)
    second = others[first_count:] + [relative]
    rng.shuffle(second)
    facts: dict[str, tuple[int, str, str]] = {}
    paragraphs = []
    for position, relations in enumerate((first, second)):
        sentences = []
        for number, relation in enumerate(relations):
            if position == 0:
                subject = entity.name if number == 0 or rng.random() < 0.5 else entity.pronoun
            else:
                subject = _reference(entity, rng)
            sentence = _sentence(relation, subject, values[relation], rng)
            facts[relation] = (position, sentence, values[relation])
            sentences.append(sentence)
        paragraphs.append(" ".join(sentences))
    return CrossChunkDocument(doc_id, entity.entity_id, entity.name, tuple(paragraphs), facts)


def generate_cross_chunk_world(seed: int, *, num_people: int = 10, num_organisations: int = 6, num_places: int = 6,
                               num_products: int = 6) -> CrossChunkWorld:
    """The cross-chunk world of `seed`: the entities of `synthetic_qa.generate_world` (a smaller world) written as
    two-chunk documents. A pure function of the arguments."""
    world = generate_world(seed, num_people=num_people, num_organisations=num_organisations, num_places=num_places,
                           num_products=num_products)
    rng = random.Random(f"cross-chunk-world-{seed}")
    pools = name_pools()
    place_names = [entity.name for entity in world.entities if entity.kind == "place"]
    documents = tuple(write_cross_chunk_document(entity, f"x{seed}-{entity.entity_id}", rng, pools, place_names)
                      for entity in world.entities)
    return CrossChunkWorld(seed, world.entities, documents)


def question_about(world: CrossChunkWorld, entity: Entity, relation: str, rng: random.Random,
                   question_id: str) -> CrossChunkQuestion:
    """Ask `relation` of `entity` by name; the answer is the fact's value, needed chunks from where it sits."""
    document = world.document_of(entity.entity_id)
    position, _, value = document.facts[relation]
    templates = EXTRA_QUESTIONS.get(relation) or QUESTION_TEMPLATES[relation]
    needed = tuple(range(position + 1)) if position else (0,)
    return CrossChunkQuestion(question_id, rng.choice(templates).format(X=entity.name), value, (document.doc_id,), 1,
                              (relation,), needed, "cross" if position else "single")


def generate_cross_chunk_questions(world: CrossChunkWorld, seed: int, count: int, *,
                                   cross_share: float = 0.5) -> list[CrossChunkQuestion]:
    """`count` distinct questions about `world` (entity, relation), `cross_share` of them cross-chunk."""
    rng = random.Random(f"cross-chunk-questions-{world.seed}-{seed}")
    options = {"single": [], "cross": []}
    for entity in world.entities:
        for relation, (position, _, _) in world.document_of(entity.entity_id).facts.items():
            options["cross" if position else "single"].append((entity, relation))
    for group in options.values():
        rng.shuffle(group)
    questions: list[CrossChunkQuestion] = []
    while len(questions) < count and (options["single"] or options["cross"]):
        kind = "cross" if rng.random() < cross_share else "single"
        group = options[kind] or options["single" if kind == "cross" else "cross"]
        entity, relation = group.pop()
        questions.append(question_about(world, entity, relation, rng, f"x{world.seed}-q{seed}-{len(questions)}"))
    return questions


def write_cross_chunk_corpus(world: CrossChunkWorld, questions: Sequence[CrossChunkQuestion],
                             directory: str | Path) -> Path:
    """`directory/documents/<doc_id>.md` (paragraphs separated by blank lines) and `directory/questions.jsonl`;
    returns the documents directory."""
    directory = Path(directory)
    documents_dir = directory / "documents"
    documents_dir.mkdir(parents=True, exist_ok=True)
    for document in world.documents:
        (documents_dir / f"{document.doc_id}.md").write_text(document.text + "\n", encoding="utf-8")
    with (directory / "questions.jsonl").open("w", encoding="utf-8") as handle:
        for question in questions:
            handle.write(json.dumps(asdict(question)) + "\n")
    return documents_dir


def cross_chunk_chunker(tokenizer):
    """The index's chunker for these worlds (the project's own, at `CROSS_CHUNK_TOKENS`)."""
    from hypic_rag.retrieval.chunking import Chunker, ChunkerConfig

    return Chunker(tokenizer, ChunkerConfig(chunk_tokens=CROSS_CHUNK_TOKENS,
                                            paragraph_fill=CROSS_CHUNK_PARAGRAPH_FILL))


def check_dependencies(document: CrossChunkDocument, chunk_texts: Sequence[str],
                       questions: Sequence[CrossChunkQuestion]) -> list[str]:
    """What is wrong with `document`'s dependencies as the chunker cut it (`chunk_texts`, in document order), for
    its `questions`: empty when every claim holds. Claims: every fact's sentence lies in the chunk its record
    says; no chunk after the first holds the entity's name (so it cannot say whom it is about); a cross-chunk
    question's answer sentence is in a later chunk and the name only in chunk 0 (the other needed chunk); a
    single-chunk question's answer and the name share chunk 0."""
    problems = []
    for relation, (position, sentence, _) in document.facts.items():
        if position >= len(chunk_texts) or sentence not in chunk_texts[position]:
            problems.append(f"{document.doc_id}: the {relation} sentence is not in chunk {position}")
    if not chunk_texts or document.name not in chunk_texts[0]:
        problems.append(f"{document.doc_id}: chunk 0 does not name {document.name!r}")
    for position, text in enumerate(chunk_texts[1:], start=1):
        if document.name in text:
            problems.append(f"{document.doc_id}: chunk {position} repeats the name {document.name!r}")
    for question in questions:
        if question.gold_doc_ids != (document.doc_id,):
            continue
        position, sentence, value = document.facts[question.relations[0]]
        holding = [number for number, text in enumerate(chunk_texts) if sentence in text]
        if question.answer != value or not holding:
            problems.append(f"{question.question_id}: its answer is not stated in the document")
            continue
        if question.kind == "cross":
            if holding[0] == 0 or question.needed_chunks != tuple(range(holding[0] + 1)):
                problems.append(f"{question.question_id}: cross-chunk, but its answer sits in chunk {holding[0]}")
        elif holding[0] != 0 or question.needed_chunks != (0,):
            problems.append(f"{question.question_id}: single-chunk, but its answer sits in chunk {holding[0]}")
    return problems


def sample_cross_chunk_context(seed: int, num_documents: int, num_questions: int,
                               partial_share: float = 0.3) -> tuple[list[Document], list[CrossChunkQuestion]]:
    """A fully attended training context from the cross-chunk world of `seed`: `num_documents` documents, each
    whole (its chunks in document order, together) or, with probability `partial_share`, only one of its chunks
    (as a retriever returns them); documents shuffled, half of them of one kind (confusable). Questions: facts
    whose needed chunks are all in the context, cross-chunk and single-chunk alike."""
    rng = random.Random(f"cross-chunk-context-{seed}")
    world = generate_cross_chunk_world(seed)
    kind = rng.choice(("person", "organisation", "place", "product"))
    same = [document for document, entity in zip(world.documents, world.entities) if entity.kind == kind]
    others = [document for document, entity in zip(world.documents, world.entities) if entity.kind != kind]
    half = min(len(same), (num_documents + 1) // 2)
    chosen = rng.sample(same, half) + rng.sample(others, num_documents - half)
    rng.shuffle(chosen)
    chunks: list[Document] = []
    present: set[tuple[str, int]] = set()
    for document in chosen:
        positions = list(range(len(document.paragraphs)))
        if rng.random() < partial_share:
            positions = [rng.choice(positions)]
        for position in positions:
            chunks.append(Document(f"{document.doc_id}#{position}", document.entity_id, document.name,
                                   document.paragraphs[position]))
            present.add((document.doc_id, position))
    options = [(world.document_of(document.entity_id), relation) for document in chosen
               for relation in document.facts]
    rng.shuffle(options)
    entities = {entity.entity_id: entity for entity in world.entities}
    questions: list[CrossChunkQuestion] = []
    for document, relation in options:
        question = question_about(world, entities[document.entity_id], relation, rng, f"xt{seed}-{len(questions)}")
        if all((document.doc_id, position) in present for position in question.needed_chunks):
            questions.append(question)
        if len(questions) >= num_questions:
            break
    return chunks, questions
