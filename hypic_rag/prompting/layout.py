"""How a RAG request is laid out as segments: prefix, one segment per retrieved chunk, then the question.

Every segment is tokenized on its own (never as one concatenated string, `tokenize_segment`), so a chunk's token
ids are the same wherever it lands and its cached entry can be reused. Training data for the default model uses the
same layout. The whole format is recorded in an index's manifest: the chunk template decides the stored token ids,
the prefix decides the prefix segment's cache entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hypic_rag.runtime.request import Request
from hypic_rag.utils.text import unencodable_message


@dataclass(frozen=True, slots=True)
class PromptFormat:
    """Text templates of the three kinds of segment.

    prefix: the fixed instruction at position 0 (cached like a chunk, always exact).
    chunk_template: formats one retrieved chunk's text; `{text}` is the chunk.
    question_template: the final segment; `{question}` is the user's question. The answer follows it.
    answer_stop: generation stops at this string (besides the tokenizer's end-of-sequence token).
    """

    prefix: str = "Answer the question from the documents.\n"
    chunk_template: str = "{text}\n"
    question_template: str = "Question: {question}\nAnswer:"
    answer_stop: str = "\n"

    def __post_init__(self) -> None:
        if "{text}" not in self.chunk_template:
            raise ValueError("chunk_template must contain '{text}'")
        if "{question}" not in self.question_template:
            raise ValueError("question_template must contain '{question}'")

    def chunk(self, text: str) -> str:
        return self.chunk_template.format(text=text)

    def question(self, question: str) -> str:
        return self.question_template.format(question=question)

    def request(self, tokenizer: Any, chunks: Sequence[str], question: str) -> Request:
        """The request of `question` over `chunks` (texts) in this format: the prefix, one formatted segment per
        chunk, the formatted question, each tokenized on its own (`tokenize_segment`). The product builds its
        requests with `hypic_rag.pipeline.session.ModelSession.request`, which also strips the question and drops empty
        chunks; this is the same layout for a bare tokenizer."""
        return Request(
            prefix_ids=tokenize_segment(tokenizer, self.prefix),
            chunk_ids=[tokenize_segment(tokenizer, self.chunk(text)) for text in chunks],
            question_ids=tokenize_segment(tokenizer, self.question(question), "the question"),
        )

    def to_dict(self) -> dict[str, str]:
        return {name: getattr(self, name) for name in self.__slots__}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PromptFormat:
        """The format `to_dict` wrote; a missing field takes its default (TypeError for unknown fields)."""
        return cls(**{name: str(value) for name, value in data.items()})


DEFAULT_PROMPT_FORMAT = PromptFormat()

TRAILING_SPACE = " \t"
"""What `split_trailing_space` moves from the end of a prompt into the answer."""


def split_trailing_space(query: str) -> tuple[str, str]:
    """`query` without its trailing spaces and tabs, and those characters ("" when there are none, or when nothing
    else is left).

    BPE and SentencePiece tokenizers attach a word's leading space to the word (`" diving"` is one token), so a
    prompt ending in a space ends in a token that never precedes an answer in training: the bundled model, trained
    on `"Answer:"` followed by `" diving"`, writes a newline after `"Answer: "` and stops there. The space is taken
    off the prompt and the generation leaves it out of the answer's start (`Request.answer_lead`), so the text of
    prompt + answer reads as it was sent. Newlines are kept: they end a line the template meant to end.
    """
    stripped = query.rstrip(TRAILING_SPACE)
    return (stripped, query[len(stripped):]) if stripped else (query, "")


def tokenize_segment(tokenizer: Any, text: str, what: str = "the text") -> list[int]:
    """Token ids of one prompt segment, tokenized on its own without special tokens ([] for empty text).

    ValueError naming `what` when `text` holds a lone surrogate (no tokenizer takes one).
    """
    message = unencodable_message(text, what)
    if message is not None:
        raise ValueError(message)
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]) if text else []


def tokenize_query(tokenizer: Any, text: str, what: str = "the question") -> tuple[list[int], str]:
    """Token ids of a prompt's last segment (the query, after which the answer comes), its trailing spaces taken
    off (`split_trailing_space`), and the whitespace taken off (the request's `answer_lead`)."""
    query, lead = split_trailing_space(text)
    return tokenize_segment(tokenizer, query, what), lead
