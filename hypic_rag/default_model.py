"""Where the bundled default model lives: a small trained `qwen3_5` hybrid (see its MODEL_CARD.md)."""

from __future__ import annotations

from pathlib import Path

_ASSETS = Path(__file__).resolve().parent / "assets"


def default_model_path() -> Path:
    """The directory of the bundled default model (config.json, model.safetensors, tokenizer, MODEL_CARD.md)."""
    return _ASSETS / "default_model"


def example_corpus_path() -> Path:
    """The bundled example corpus: `documents/*.md` (one fictional entity each) and `questions.jsonl`."""
    return _ASSETS / "example_corpus"
