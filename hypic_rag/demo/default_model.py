"""Where the bundled default model lives: a small trained `qwen3_5` hybrid (see its MODEL_CARD.md)."""

from __future__ import annotations

from pathlib import Path

from hypic_rag.errors import MissingPathError

_ASSETS = Path(__file__).resolve().parent / "assets"


def default_model_path() -> Path:
    """The directory of the bundled default model (config.json, model.safetensors, tokenizer, MODEL_CARD.md)."""
    return _ASSETS / "default_model"


def example_corpus_path() -> Path:
    """The bundled example corpus: `documents/*.md` (one fictional entity each) and `questions.jsonl`."""
    return _ASSETS / "example_corpus"


ACCURACY_TARGET = 0.9
"""Held-out exact match under `full` that makes the bundled model answer-grade."""


def measured_accuracy() -> float | None:
    """The bundled model's held-out exact match under `full` (k = 8, real retriever), as recorded in
    `evaluation.json` beside the weights by `evals/eval_default_model.py`; None when not recorded."""
    import json

    path = default_model_path() / "evaluation.json"
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    modes = report.get("modes", {})
    row = modes.get("full") or modes.get("hf")
    return float(row["exact_match"]) if row else None


def answers_reliably() -> tuple[bool, str]:
    """(True, "") when the bundled model exists and reached ACCURACY_TARGET; else (False, why). Tests that check
    answers for correctness run only then; everything else runs on the shipped model whatever its accuracy."""
    if not (default_model_path() / "config.json").is_file():
        return False, "the bundled default model is missing (hypic_rag/demo/assets/default_model)"
    accuracy = measured_accuracy()
    if accuracy is None:
        return False, "the bundled model has no recorded held-out accuracy (evaluation.json)"
    if accuracy < ACCURACY_TARGET:
        return False, f"the bundled model's held-out exact match {accuracy:.1%} is below the {ACCURACY_TARGET:.0%} target"
    return True, ""


def resolve_model_path(given: str | Path | None) -> Path:
    """`given` (a local checkpoint directory), else the bundled default model.

    Raises `MissingPathError` (a FileNotFoundError, exit code 2) with a one-line message when the directory or the
    bundled model is missing.
    """
    if given is not None:
        path = Path(given).expanduser()
        if not (path / "config.json").is_file():
            raise MissingPathError(f"model directory {str(given)!r} does not exist or has no config.json")
        return path
    default = default_model_path()
    if not (default / "config.json").is_file():
        raise MissingPathError("no model given and the bundled default model is not installed; pass a model directory")
    return default
