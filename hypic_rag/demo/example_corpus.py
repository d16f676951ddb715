"""The bundled example corpus: `documents/*.md` (one fictional entity each) and its questions (`questions.jsonl`).

The corpus was written by the repository's synthetic-data generator (`training/data/synthetic_qa.py`, not part of
the installed package); the product only reads it: the demo, the examples and the tests ask its questions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hypic_rag.demo.default_model import example_corpus_path

TWO_HOP_SEPARATOR = " -> "
"""Two-hop answers are written `bridge -> answer` so the model names the bridge entity before the answer."""


@dataclass(frozen=True, slots=True)
class Question:
    """A question with its gold answer text and the documents that hold the answer (two for two-hop)."""

    question_id: str
    text: str
    answer: str
    gold_doc_ids: tuple[str, ...]
    hops: int
    relations: tuple[str, ...]

    @property
    def final_answer(self) -> str:
        """The answer without the two-hop bridge (`bridge -> answer` -> `answer`)."""
        return self.answer.split(TWO_HOP_SEPARATOR)[-1]


def read_questions(path: str | Path | None = None) -> list[Question]:
    """Questions of a corpus written in this layout (one JSON object per line); default: the bundled corpus."""
    path = Path(path) if path is not None else example_corpus_path() / "questions.jsonl"
    questions = []
    for line in path.read_text(encoding="utf-8").splitlines():
        data = json.loads(line)
        data["gold_doc_ids"] = tuple(data["gold_doc_ids"])
        data["relations"] = tuple(data["relations"])
        questions.append(Question(**data))
    return questions
