"""Helpers for tests and examples of the service and integrations: a small corpus, a tiny model, an index.

    model = tiny_model_checkpoint(tmp / "model")              # tiny random qwen3_5 + trained BPE (seconds)
    index = build_index(tmp / "index", model, SMALL_CORPUS)   # chunk, embed, index, encode every chunk

With the tiny random model answers are gibberish; retrieval (the shipped MiniLM embedder), streaming, token
accounting and cache behaviour are real. Answer correctness needs the bundled default model.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from pathlib import Path

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
    from hypic_rag.testing import save_tiny_checkpoint

    directory = Path(directory)
    if (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file():
        return directory
    corpus = texts if texts is not None else list(SMALL_CORPUS.values()) + list(SMALL_CORPUS_QUESTIONS.values())
    return save_tiny_checkpoint(directory, corpus * 4)


def write_corpus(directory: Path, documents: Mapping[str, str]) -> Path:
    """Write `documents` (file name -> text) into `directory`; returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in documents.items():
        (directory / name).write_text(text + "\n", encoding="utf-8")
    return directory


def build_index(
    directory: Path,
    model_path: Path,
    documents: Mapping[str, str] | Path,
    *,
    chunk_tokens: int = 96,
    seam_tokens: int = 8,
) -> Path:
    """Precompute an index of `documents` (a mapping written to `<directory>.corpus`, or a corpus path)."""
    from hypic_rag.retrieval.precompute import PrecomputeOptions, precompute

    directory = Path(directory)
    if isinstance(documents, Path):
        corpus = documents
    else:
        corpus = write_corpus(directory.with_name(directory.name + ".corpus"), documents)
    precompute(
        PrecomputeOptions(
            corpus=corpus,
            index_dir=directory,
            model_path=Path(model_path),
            chunk_tokens=chunk_tokens,
            seam_tokens=seam_tokens,
            device="cpu",
            show_progress=False,
        )
    )
    return directory


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for a server started in another process)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
