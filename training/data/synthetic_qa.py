"""A deterministic synthetic multi-document QA corpus of fictional entities.

A *world* (one per seed) holds people, organisations, places and products with attributes; some attributes link
to another entity of the world (a person works for an organisation, a product is made by one, ...). Each entity
is written as one short document of several sentences whose templates, sentence order and subject references
(full name or pronoun) vary, so a reader must read rather than rely on a fixed layout. Questions are single-hop
(the answer is an attribute value in one document) or two-hop (follow a link to a second document; the gold
answer then names the bridge entity first: ``"Brightwave Labs -> Kelmora"``).

Everything is a pure function of the seed: `generate_world(seed)`, `generate_questions(world, seed, n)`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from training.data.name_pools import (
    COLOURS,
    HOBBIES,
    INDUSTRIES,
    KNOWN_FOR,
    ORGANISATION_SUFFIXES,
    PRODUCT_CATEGORIES,
    PROFESSIONS,
    name_pools,
)

from hypic_rag.demo.example_corpus import TWO_HOP_SEPARATOR, Question, read_questions  # noqa: F401 (re-exported)

KINDS = ("person", "organisation", "place", "product")


@dataclass(frozen=True, slots=True)
class Entity:
    """One fictional entity: `attributes` maps a relation to its value text; `links` maps a relation whose
    value is another entity of the world to that entity's id."""

    entity_id: str
    kind: str
    name: str
    pronoun: str
    attributes: dict[str, str]
    links: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Document:
    """One entity written as a short paragraph (one chunk at query time)."""

    doc_id: str
    entity_id: str
    title: str
    text: str


@dataclass(frozen=True, slots=True)
class World:
    """All entities of one seed and their documents (index i of `documents` describes `entities[i]`)."""

    seed: int
    entities: tuple[Entity, ...]
    documents: tuple[Document, ...]

    def entity(self, entity_id: str) -> Entity:
        return self._by_id()[entity_id]

    def document_of(self, entity_id: str) -> Document:
        return self.documents[self._index()[entity_id]]

    def _by_id(self) -> dict[str, Entity]:
        return {entity.entity_id: entity for entity in self.entities}

    def _index(self) -> dict[str, int]:
        return {entity.entity_id: index for index, entity in enumerate(self.entities)}


# ---------------------------------------------------------------- document templates
# Each relation has several sentence templates; {S} is the subject (name or pronoun), {v} the value.
SENTENCE_TEMPLATES: dict[str, tuple[str, ...]] = {
    "lives_in": ("{S} lives in {v}.", "{S} has a home in {v}.", "{S} resides in the city of {v}."),
    "works_for": ("{S} works for {v}.", "{S} is employed by {v}.", "{S} has a job at {v}."),
    "profession": ("{S} works as {a_v}.", "{S} is {a_v} by trade.", "{S} earns a living as {a_v}."),
    "born_year": ("{S} was born in {v}.", "{S} came into the world in {v}."),
    "hobby": ("{S} enjoys {v}.", "{S} spends free evenings on {v}.", "{S} likes {v} more than anything."),
    "based_in": ("{S} is based in {v}.", "{S} has its headquarters in {v}.", "{S} runs its business from {v}."),
    "founded_year": ("{S} was founded in {v}.", "{S} was set up in {v}.", "{S} opened its doors in {v}."),
    "industry": ("{S} works in {v}.", "{S} is active in {v}.", "{S} makes its money in {v}."),
    "led_by": ("{S} is led by {v}.", "{S} is run by {v}.", "{S} has {v} as its chief."),
    "region": ("{S} lies in the region of {v}.", "{S} is part of {v}.", "{S} belongs to the region {v}."),
    "river": ("{S} sits on the river {v}.", "{S} is crossed by the river {v}.", "{S} lies along the {v} river."),
    "mayor": ("{S} has {v} as its mayor.", "{S} is governed by mayor {v}.", "{S} elected {v} as mayor."),
    "known_for": ("{S} is known for its {v}.", "{S} is famous for its {v}.", "{S} draws visitors with its {v}."),
    "made_by": ("{S} is made by {v}.", "{S} is produced by {v}.", "{S} comes from the workshops of {v}."),
    "launch_year": ("{S} was launched in {v}.", "{S} came out in {v}.", "{S} first went on sale in {v}."),
    "category": ("{S} is {a_v}.", "{S} is sold as {a_v}.", "{S} is a kind of {v}."),
    "colour": ("{S} is painted {v}.", "{S} comes in {v}.", "{S} has a {v} finish."),
}

RELATIONS_OF_KIND: dict[str, tuple[str, ...]] = {
    "person": ("lives_in", "works_for", "profession", "born_year", "hobby"),
    "organisation": ("based_in", "founded_year", "industry", "led_by"),
    "place": ("region", "river", "mayor", "known_for"),
    "product": ("made_by", "launch_year", "category", "colour"),
}

LINK_TARGET_KIND = {"lives_in": "place", "works_for": "organisation", "based_in": "place", "made_by": "organisation"}

PRONOUNS = {"person": ("He", "She"), "organisation": ("It", "The company"), "place": ("It", "The city"),
            "product": ("It", "The product")}

# ---------------------------------------------------------------- question templates
# Single-hop: {X} is the entity name. Two-hop: {X} is a noun phrase for the bridge entity (see BRIDGE_PHRASES).
QUESTION_TEMPLATES: dict[str, tuple[str, ...]] = {
    "lives_in": ("Where does {X} live?", "In which city does {X} live?", "What is the home city of {X}?"),
    "works_for": ("Who does {X} work for?", "Which company employs {X}?", "Who is the employer of {X}?"),
    "profession": ("What does {X} do for a living?", "What is the job of {X}?", "What is the profession of {X}?"),
    "born_year": ("When was {X} born?", "In what year was {X} born?"),
    "hobby": ("What is the hobby of {X}?", "What does {X} enjoy in free time?"),
    "based_in": ("Where is {X} based?", "In which city is {X} headquartered?", "Where are the headquarters of {X}?"),
    "founded_year": ("When was {X} founded?", "In what year was {X} founded?"),
    "industry": ("What industry is {X} in?", "In which industry does {X} work?"),
    "led_by": ("Who leads {X}?", "Who runs {X}?", "Who is the chief of {X}?"),
    "region": ("In which region is {X}?", "What region does {X} belong to?"),
    "river": ("Which river runs through {X}?", "On which river does {X} lie?"),
    "mayor": ("Who is the mayor of {X}?", "Who governs {X}?"),
    "known_for": ("What is {X} known for?", "What is {X} famous for?"),
    "made_by": ("Who makes {X}?", "Which company produces {X}?", "Who is the maker of {X}?"),
    "launch_year": ("When was {X} launched?", "In what year did {X} come out?"),
    "category": ("What kind of product is {X}?", "What sort of product is {X}?"),
    "colour": ("What colour is {X}?", "Which colour does {X} come in?"),
}

BRIDGE_PHRASES: dict[str, tuple[str, ...]] = {
    "lives_in": ("the city where {N} lives", "the home city of {N}"),
    "works_for": ("the employer of {N}", "the company that employs {N}"),
    "based_in": ("the city where {N} is based", "the headquarters city of {N}"),
    "made_by": ("the maker of {N}", "the company that makes {N}"),
}


def _with_article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


# ---------------------------------------------------------------- world generation
def _years(rng: random.Random, low: int, high: int) -> str:
    return str(rng.randint(low, high))


def generate_world(
    seed: int,
    *,
    num_people: int = 24,
    num_organisations: int = 10,
    num_places: int = 10,
    num_products: int = 10,
    name_share: float = 0.5,
) -> World:
    """A world of fictional entities and one document per entity, a pure function of the arguments.

    name_share: probability that a sentence after the first names its subject in full (else a pronoun).
    """
    rng = random.Random(f"world-{seed}")
    pools = name_pools()
    people_names = _unique(rng, num_people, lambda: f"{rng.choice(pools.first_names)} {rng.choice(pools.last_names)}")
    org_names = _unique(rng, num_organisations, lambda: f"{rng.choice(pools.organisation_stems)} {rng.choice(ORGANISATION_SUFFIXES)}")
    place_names = rng.sample(pools.places, num_places)
    product_names = _unique(rng, num_products, lambda: f"{rng.choice(pools.product_stems)} {rng.randint(2, 9)}")
    outside_names = [f"{rng.choice(pools.first_names)} {rng.choice(pools.last_names)}" for _ in range(num_places + num_organisations)]
    outside_names = [name for name in outside_names if name not in people_names]

    def pick_link(kind: str, names: Sequence[str]) -> tuple[str, str | None]:
        index = rng.randrange(len(names)) if names else None
        if index is None:
            fallback = rng.choice(pools.places) if kind == "place" else f"{rng.choice(pools.organisation_stems)} Group"
            return fallback, None
        return names[index], f"{kind}-{index}"

    entities: list[Entity] = []
    for index, name in enumerate(place_names):
        attributes = {
            "region": rng.choice(pools.regions),
            "river": rng.choice(pools.rivers),
            "mayor": rng.choice(outside_names or people_names),
            "known_for": rng.choice(KNOWN_FOR),
        }
        entities.append(Entity(f"place-{index}", "place", name, "", attributes))
    for index, name in enumerate(org_names):
        city, city_id = pick_link("place", place_names)
        attributes = {
            "based_in": city,
            "founded_year": _years(rng, 1850, 2015),
            "industry": rng.choice(INDUSTRIES),
            "led_by": rng.choice(outside_names or people_names),
        }
        entities.append(Entity(f"organisation-{index}", "organisation", name, "", attributes,
                               {"based_in": city_id} if city_id else {}))
    for index, name in enumerate(people_names):
        city, city_id = pick_link("place", place_names)
        employer, employer_id = pick_link("organisation", org_names)
        attributes = {
            "lives_in": city,
            "works_for": employer,
            "profession": rng.choice(PROFESSIONS),
            "born_year": _years(rng, 1940, 2005),
            "hobby": rng.choice(HOBBIES),
        }
        links = {relation: target for relation, target in (("lives_in", city_id), ("works_for", employer_id)) if target}
        entities.append(Entity(f"person-{index}", "person", name, rng.choice(PRONOUNS["person"]), attributes, links))
    for index, name in enumerate(product_names):
        maker, maker_id = pick_link("organisation", org_names)
        attributes = {
            "made_by": maker,
            "launch_year": _years(rng, 1950, 2024),
            "category": rng.choice(PRODUCT_CATEGORIES),
            "colour": rng.choice(COLOURS),
        }
        entities.append(Entity(f"product-{index}", "product", name, "", attributes, {"made_by": maker_id} if maker_id else {}))
    entities = [
        entity if entity.pronoun else Entity(entity.entity_id, entity.kind, entity.name, rng.choice(PRONOUNS[entity.kind]),
                                             entity.attributes, entity.links)
        for entity in entities
    ]
    documents = tuple(
        Document(f"s{seed}-{entity.entity_id}", entity.entity_id, entity.name, write_document(entity, rng, name_share))
        for entity in entities
    )
    return World(seed, tuple(entities), documents)


def _unique(rng: random.Random, count: int, draw) -> list[str]:
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < count:
        name = draw()
        if name not in seen:
            seen.add(name)
            names.append(name)
    return names


def write_document(entity: Entity, rng: random.Random, name_share: float = 0.5) -> str:
    """One paragraph about `entity`: one sentence per attribute in random order, the first naming the entity in
    full, later ones naming it or using a pronoun."""
    relations = list(entity.attributes)
    rng.shuffle(relations)
    sentences = []
    for position, relation in enumerate(relations):
        value = entity.attributes[relation]
        if position == 0 or rng.random() < name_share:
            subject = entity.name
        else:
            subject = entity.pronoun
        template = rng.choice(SENTENCE_TEMPLATES[relation])
        sentences.append(template.format(S=subject, v=value, a_v=_with_article(value)))
    return " ".join(sentences)


# ---------------------------------------------------------------- questions
def single_hop_question(world: World, entity: Entity, relation: str, rng: random.Random, question_id: str) -> Question:
    """Ask for `relation` of `entity`; the answer is the attribute value in the entity's document."""
    template = rng.choice(QUESTION_TEMPLATES[relation])
    return Question(
        question_id,
        template.format(X=entity.name),
        entity.attributes[relation],
        (world.document_of(entity.entity_id).doc_id,),
        1,
        (relation,),
    )


def two_hop_question(
    world: World, entity: Entity, link_relation: str, target_relation: str, rng: random.Random, question_id: str
) -> Question:
    """Ask for `target_relation` of the entity that `entity` links to through `link_relation`."""
    bridge = world.entity(entity.links[link_relation])
    phrase = rng.choice(BRIDGE_PHRASES[link_relation]).format(N=entity.name)
    text = rng.choice(QUESTION_TEMPLATES[target_relation]).format(X=phrase)
    text = text[0].upper() + text[1:]
    return Question(
        question_id,
        text,
        f"{bridge.name}{TWO_HOP_SEPARATOR}{bridge.attributes[target_relation]}",
        (world.document_of(entity.entity_id).doc_id, world.document_of(bridge.entity_id).doc_id),
        2,
        (link_relation, target_relation),
    )


def two_hop_options(world: World, entity: Entity) -> list[tuple[str, str]]:
    """(link relation, target relation) pairs that make a two-hop question about `entity` in `world`."""
    options = []
    for link_relation, target_id in entity.links.items():
        bridge = world.entity(target_id)
        options.extend((link_relation, relation) for relation in RELATIONS_OF_KIND[bridge.kind])
    return options


def generate_questions(world: World, seed: int, count: int, *, two_hop_share: float = 0.2) -> list[Question]:
    """`count` questions about `world`, a share of them two-hop, deterministic from `seed`. Distinct questions
    (entity, relation path) while the world has enough of them."""
    rng = random.Random(f"questions-{world.seed}-{seed}")
    questions: list[Question] = []
    seen: set[tuple[str, tuple[str, ...]]] = set()
    attempts = 0
    while len(questions) < count and attempts < 50 * count:
        attempts += 1
        entity = rng.choice(world.entities)
        question_id = f"s{world.seed}-q{seed}-{len(questions)}"
        options = two_hop_options(world, entity)
        if options and rng.random() < two_hop_share:
            link_relation, target_relation = rng.choice(options)
            key = (entity.entity_id, (link_relation, target_relation))
            if key in seen:
                continue
            question = two_hop_question(world, entity, link_relation, target_relation, rng, question_id)
        else:
            relation = rng.choice(RELATIONS_OF_KIND[entity.kind])
            key = (entity.entity_id, (relation,))
            if key in seen:
                continue
            question = single_hop_question(world, entity, relation, rng, question_id)
        seen.add(key)
        questions.append(question)
    return questions


def distractor_context(
    world: World, question: Question, num_chunks: int, rng: random.Random
) -> list[Document]:
    """The gold document(s) of `question` plus random other documents of the world, shuffled (`num_chunks` in
    all): the evaluation context used before a real retriever is available."""
    gold = [doc for doc in world.documents if doc.doc_id in question.gold_doc_ids]
    others = [doc for doc in world.documents if doc.doc_id not in question.gold_doc_ids]
    context = gold + rng.sample(others, max(0, num_chunks - len(gold)))
    rng.shuffle(context)
    return context


# ---------------------------------------------------------------- example corpus files
def write_corpus(world: World, questions: Sequence[Question], directory: str | Path) -> Path:
    """Write `world`'s documents as `directory/documents/<doc_id>.md` (the paragraph alone) and the questions
    as `directory/questions.jsonl` (kept outside `documents/` so a corpus loader never indexes them).
    Returns the documents directory."""
    directory = Path(directory)
    documents_dir = directory / "documents"
    documents_dir.mkdir(parents=True, exist_ok=True)
    for document in world.documents:
        (documents_dir / f"{document.doc_id}.md").write_text(f"{document.text}\n", encoding="utf-8")
    with (directory / "questions.jsonl").open("w", encoding="utf-8") as handle:
        for question in questions:
            handle.write(json.dumps(asdict(question)) + "\n")
    return documents_dir


HELDOUT_SEED = 900_000_000
"""Seed of the held-out evaluation worlds (never used in training or validation)."""

EXAMPLE_CORPUS_SEED = 777_000_000
"""The world of the bundled example corpus (never used in training, validation or the held-out benchmark)."""


def write_example_corpus(directory: str | Path, num_questions: int = 24) -> Path:
    """Write the bundled example corpus (`documents/*.md`, `questions.jsonl`) to `directory`."""
    world = generate_world(EXAMPLE_CORPUS_SEED)
    questions = generate_questions(world, EXAMPLE_CORPUS_SEED, num_questions, two_hop_share=0.25)
    return write_corpus(world, questions, directory)
