"""Small corpora, indexes, chat-templated checkpoints and random requests the tests share."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hypic_rag.testing.tiny import save_tiny_checkpoint


SMALL_CORPUS: dict[str, str] = {
    "glassblowing.md": (
        "Alice Marlow is a glassblower who lives in Pellington. She founded the Amber Kiln studio in 1998 and "
        "teaches evening classes there."
    ),
    "astronomy.md": (
        "Bob Tanaka is an astronomer at the Ridgeview Observatory. He discovered the comet Tanaka-3 in 2011 "
        "with a small refracting telescope."
    ),
    "lavender.md": (
        "Carol Esposito grows lavender on a farm near the river Vell. Her farm also keeps bees and sells honey "
        "at the Saturday market."
    ),
    "bicycles.md": (
        "Dmitri Volkov repairs vintage bicycles in a workshop in Harrow Cove. He rebuilt his first racing frame "
        "when he was twelve."
    ),
    "volcano.md": (
        "Mount Keral is a dormant volcano on the island of Tessaly. Its last eruption, in 1821, covered the "
        "eastern villages in ash."
    ),
    "chess.md": (
        "The Westbrook Chess Club meets every Thursday in the old library. Its champion, Elena Ruiz, has won "
        "the regional tournament four times."
    ),
}
"""Six one-paragraph documents on unrelated topics; `SMALL_CORPUS_QUESTIONS` asks one question about each."""

SMALL_CORPUS_QUESTIONS: dict[str, str] = {
    "glassblowing.md": "Who founded the Amber Kiln glass studio?",
    "astronomy.md": "Which astronomer discovered a comet with a telescope?",
    "lavender.md": "Who grows lavender and sells honey?",
    "bicycles.md": "Who repairs old racing bicycles?",
    "volcano.md": "When did the volcano Mount Keral last erupt?",
    "chess.md": "Who is the champion of the chess club?",
}


def tiny_model_checkpoint(directory: Path, texts: list[str] | None = None) -> Path:
    """A tiny random qwen3_5 checkpoint whose tokenizer was trained on `texts` (default: the small corpus);
    reused when `directory` already holds one."""
    directory = Path(directory)
    if (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file():
        return directory
    corpus = texts if texts is not None else list(SMALL_CORPUS.values()) + list(SMALL_CORPUS_QUESTIONS.values())
    return save_tiny_checkpoint(directory, corpus * 4)


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A ChatML-style chat template (the layout of Qwen checkpoints' templates) for tiny test checkpoints."""


def templated_checkpoint(directory: Path, base: Path, template: str = TINY_CHAT_TEMPLATE) -> Path:
    """A copy of the checkpoint `base` whose tokenizer carries `template` as its chat template (reused when
    `directory` already holds one)."""
    import shutil

    from transformers import AutoTokenizer

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        shutil.copytree(base, directory)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        tokenizer.chat_template = template
        tokenizer.save_pretrained(directory)
    return directory


def write_corpus(directory: Path, documents: Mapping[str, str]) -> Path:
    """Write `documents` (file name -> text) into `directory`; returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in documents.items():
        (directory / name).write_text(text + "\n", encoding="utf-8")
    return directory


def build_index(
    directory: Path, model_path: Path, documents: Mapping[str, str] | Path, *, chunk_tokens: int = 96,
    seam_tokens: int = 8,
) -> Path:
    """Precompute an index of `documents` (a mapping written to `<directory>.corpus`, or a corpus path) on CPU,
    quietly (`hypic_rag.build_index`); returns `directory`."""
    from hypic_rag.pipeline.precompute import build_index as build

    directory = Path(directory)
    if isinstance(documents, Path):
        corpus = documents
    else:
        corpus = write_corpus(directory.with_name(directory.name + ".corpus"), documents)
    build(corpus, directory, model=model_path, chunk_tokens=chunk_tokens, seam_tokens=seam_tokens, device="cpu",
          show_progress=False)
    return directory


def random_request(
    source: int | torch.Generator, chunk_lengths: list[int], prefix: int = 5, question: int = 6, *,
    vocab: int = 256, lowest: int = 0,
) -> Any:
    """A `Request` of random token ids in [lowest, vocab): a prefix of `prefix` tokens, chunks of `chunk_lengths`,
    a question of `question`; `source` a seed or a generator (drawn from in that order)."""
    from hypic_rag.runtime.request import Request

    generator = source if isinstance(source, torch.Generator) else torch.Generator().manual_seed(source)

    def ids(count: int) -> list[int]:
        return torch.randint(lowest, vocab, (count,), generator=generator).tolist()

    return Request(ids(prefix), [ids(count) for count in chunk_lengths], ids(question))
