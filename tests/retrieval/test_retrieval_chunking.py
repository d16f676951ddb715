"""Chunking with a real (trained) BPE tokenizer: limits, boundaries, stored ids, stable ids, edit locality."""

from __future__ import annotations

import random

import pytest

from hypic_rag.prompting.layout import DEFAULT_PROMPT_FORMAT, PromptFormat
from hypic_rag.retrieval.chunking import Chunker, ChunkerConfig, encode_segment_text, split_units
from hypic_rag.retrieval.loading import Document
from hypic_rag.testing import train_tiny_tokenizer

WORDS = "alpha beta gamma delta river mountain city lamp orange quiet fast green stone harbor bread".split()


def make_paragraphs(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)

    def sentence() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "."

    return [" ".join(sentence() for _ in range(rng.randint(2, 5))) for _ in range(count)]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tiny_tokenizer(["\n\n".join(make_paragraphs(0, 40)), "x" * 50, "0123456789 word word"])


def test_chunks_fit_the_limit_and_store_the_formatted_segment_ids(tokenizer) -> None:
    text = "\n\n".join(make_paragraphs(1, 30))
    chunker = Chunker(tokenizer, ChunkerConfig(chunk_tokens=48))
    chunks = chunker.chunk_document(Document("doc", text, "doc"))
    assert len(chunks) > 10
    for position, chunk in enumerate(chunks):
        assert chunk.position == position
        assert 0 < chunk.n_tokens <= 48
        assert list(chunk.token_ids) == encode_segment_text(tokenizer, DEFAULT_PROMPT_FORMAT.chunk(chunk.text))
        assert text[chunk.char_start : chunk.char_end] == chunk.text
    # nothing lost, nothing repeated: the chunks cover the document's words in order
    assert " ".join(c.text for c in chunks).split() == text.split()


def test_boundaries_fall_on_sentence_and_paragraph_ends(tokenizer) -> None:
    paragraphs = make_paragraphs(2, 24)
    text = "\n\n".join(paragraphs)
    chunks = Chunker(tokenizer, ChunkerConfig(chunk_tokens=64)).chunk_document(Document("doc", text, "doc"))
    assert all(chunk.text.endswith(".") for chunk in chunks)
    paragraph_ends = {text.index(p) + len(p) for p in paragraphs}
    at_paragraph_end = sum(chunk.char_end in paragraph_ends for chunk in chunks)
    assert at_paragraph_end >= 0.7 * len(chunks)


def test_text_without_boundaries_is_split_within_the_limit(tokenizer) -> None:
    text = "x" * 700 + " " + " ".join(str(i) for i in range(300))
    chunks = Chunker(tokenizer, ChunkerConfig(chunk_tokens=16)).chunk_document(Document("long", text, "long"))
    assert all(chunk.n_tokens <= 16 for chunk in chunks)
    assert "".join(c.text for c in chunks).replace(" ", "") == text.replace(" ", "")


def test_ids_are_stable_and_content_derived(tokenizer) -> None:
    text = "\n\n".join(make_paragraphs(3, 10))
    chunker = Chunker(tokenizer, ChunkerConfig(chunk_tokens=48))
    first = chunker.chunk_document(Document("doc", text, "doc"))
    again = chunker.chunk_document(Document("doc", text, "elsewhere"))
    other_doc = chunker.chunk_document(Document("other", text, "other"))
    assert [c.chunk_id for c in first] == [c.chunk_id for c in again]
    assert [c.token_ids for c in first] == [c.token_ids for c in other_doc]
    assert not {c.chunk_id for c in first} & {c.chunk_id for c in other_doc}


def test_repeated_text_in_one_document_is_kept_once(tokenizer) -> None:
    paragraph = make_paragraphs(4, 1)[0]
    text = "\n\n".join([paragraph, "Stone harbor.", paragraph])
    chunks = Chunker(tokenizer, ChunkerConfig(chunk_tokens=256, paragraph_fill=0.0)).chunk_document(
        Document("doc", text, "doc")
    )
    assert [c.text for c in chunks] == [paragraph, "Stone harbor."]


def test_editing_one_paragraph_changes_only_nearby_chunks(tokenizer) -> None:
    paragraphs = make_paragraphs(5, 40)
    chunker = Chunker(tokenizer, ChunkerConfig(chunk_tokens=64))
    before = chunker.chunk_document(Document("doc", "\n\n".join(paragraphs), "doc"))
    paragraphs[20] = paragraphs[20].replace(".", " near the quiet green harbor.", 1)
    after = chunker.chunk_document(Document("doc", "\n\n".join(paragraphs), "doc"))
    changed = {c.chunk_id for c in after} - {c.chunk_id for c in before}
    assert len(before) >= 20
    assert 1 <= len(changed) <= 3


def test_template_overhead_counts_against_the_limit(tokenizer) -> None:
    prompt_format = PromptFormat(chunk_template="Document:\n{text}\nEnd of document.\n")
    chunker = Chunker(tokenizer, ChunkerConfig(chunk_tokens=40), prompt_format)
    chunks = chunker.chunk_document(Document("doc", "\n\n".join(make_paragraphs(6, 8)), "doc"))
    for chunk in chunks:
        assert chunk.n_tokens <= 40
        assert list(chunk.token_ids) == encode_segment_text(tokenizer, prompt_format.chunk(chunk.text))


def test_split_units_marks_paragraph_ends() -> None:
    text = "First one. Second one!\nA line\n\n  Next paragraph? Yes."
    units = [(text[u.start : u.end], u.paragraph_end) for u in split_units(text)]
    assert units == [
        ("First one.", False),
        ("Second one!", False),
        ("A line", True),
        ("Next paragraph?", False),
        ("Yes.", True),
    ]


def test_config_is_checked(tokenizer) -> None:
    with pytest.raises(ValueError, match="chunk_tokens"):
        ChunkerConfig(chunk_tokens=4)
    with pytest.raises(ValueError, match="paragraph_fill"):
        ChunkerConfig(paragraph_fill=1.5)
    with pytest.raises(ValueError, match="leaves no room"):
        Chunker(tokenizer, ChunkerConfig(chunk_tokens=8), PromptFormat(chunk_template="x y z w v u t s r q p {text}"))


class _CallSizes:
    """The real tokenizer, recording how many characters each call is given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.largest = 0

    def __call__(self, texts, **options):
        size = len(texts) if isinstance(texts, str) else sum(len(text) for text in texts)
        self.largest = max(self.largest, size)
        return self.tokenizer(texts, **options)


@pytest.mark.parametrize(
    "text",
    [
        "\n\n".join(make_paragraphs(7, 400)) * 20,  # ~1.7 M characters of ordinary prose
        "alpha beta gamma " * 120_000,  # ~2 M characters: one "sentence", no newline, no sentence end
    ],
    ids=["prose", "one-unit"],
)
def test_chunk_steps_bound_the_work_behind_each_chunk(tokenizer, text: str) -> None:
    """A service advances an ingestion job a step at a time: cutting one chunk of a huge document must not
    tokenize the whole document (before, every unit of it was counted in one call)."""
    spy = _CallSizes(tokenizer)
    chunker = Chunker(spy, ChunkerConfig(chunk_tokens=48))
    bound = 2 * chunker.content_budget * 64  # a batch of units stops once it holds one window of text
    steps = chunker.chunk_steps(Document("huge", text, "huge"))
    produced = [next(steps) for _ in range(300)]
    assert spy.largest <= bound, f"one tokenizer call was given {spy.largest} characters"
    assert any(chunk is not None for chunk in produced)
    assert all(chunk is None or chunk.n_tokens <= 48 for chunk in produced)


def test_chunk_steps_give_the_chunks_of_chunk_document(tokenizer) -> None:
    paragraphs = make_paragraphs(8, 30)
    text = "\n\n".join(paragraphs + [paragraphs[3]])
    chunker = Chunker(tokenizer, ChunkerConfig(chunk_tokens=256, paragraph_fill=0.0))
    document = Document("doc", text, "doc")
    steps = list(chunker.chunk_steps(document))
    assert None in steps  # the repeated chunk text is a step of its own, kept once
    assert [chunk for chunk in steps if chunk is not None] == chunker.chunk_document(document)
