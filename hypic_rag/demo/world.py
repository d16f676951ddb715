"""Whether the bundled demo model is answering outside its synthetic world, and the one line that says so.

The bundled model (`hypic_rag/demo/assets/default_model`, 2.2M parameters) was trained only on synthetic worlds of
invented people, organisations, places and products (`docs/default_model.md`); on any other documents it still
answers, fluently and wrongly. Its byte-level BPE tokenizer was trained on those worlds, so every word of such a
world (template words and invented names alike) is one token, while most words of ordinary text split into several
pieces. Measured with this tokenizer: 100% single-token words on the bundled example corpus and on three other
generated worlds, 7-35% on English prose, this repository's docs and French text. A chunk is *outside the world*
when fewer than `IN_WORLD_WORD_SHARE` of its words are single tokens.

`precompute` measures every chunk of an index built for the bundled model and records the result in the manifest
(`IndexManifest.bundled_model_fit`, a `CorpusFit`); `ask`, `/v1/ask` and the pipeline's `Answer.note` carry
`DEMO_MODEL_NOTE` when the bundled model answers over such an index (or over retrieved chunks outside its world,
e.g. documents added to a running server). Any other model never gets the note.

Imports nothing heavy: the tokenizer is the caller's (the loaded model's).
"""

from __future__ import annotations

import filecmp
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypic_rag.demo.default_model import default_model_path

__all__ = [
    "DEMO_MODEL_NOTE",
    "IN_WORLD_WORD_SHARE",
    "CorpusFit",
    "WorldCheck",
    "is_bundled_model",
]

DEMO_MODEL_NOTE = (
    "note: the bundled model is a small demo trained only on a synthetic world of invented people and places; its "
    "answers about these documents are made up. For real answers, index them with a real checkpoint: hypic-rag "
    "precompute CORPUS --index DIR --model PATH"
)
"""What `precompute`, `ask` and `/v1/ask` say, once, when the bundled model works outside its world."""

IN_WORLD_WORD_SHARE = 0.9
"""A chunk with at least this share of single-token words belongs to the bundled model's world (synthetic worlds
measure 1.0, ordinary text 0.07-0.35)."""

_WORD = re.compile(r"[^\W\d_]+")
"""A word: a run of letters (numbers and punctuation say nothing about the world)."""

_MODEL_FILES = ("config.json", "model.safetensors")


def is_bundled_model(path: str | Path) -> bool:
    """True when `path` is the bundled default model's directory, or a copy of it (same config and weights)."""
    try:
        given = Path(path).expanduser().resolve()
        bundled = default_model_path().resolve()
        if given == bundled:
            return True
        return all((given / name).is_file() and (bundled / name).is_file()
                   and filecmp.cmp(given / name, bundled / name, shallow=False) for name in _MODEL_FILES)
    except OSError:
        return False


@dataclass(frozen=True, slots=True)
class CorpusFit:
    """How an index's chunks fit the bundled model's world: chunks measured, those outside the world, and the share
    of all their words that are single tokens."""

    chunks: int
    foreign_chunks: int
    single_token_word_share: float

    def __post_init__(self) -> None:
        if not 0 <= self.foreign_chunks <= self.chunks:
            raise ValueError(f"foreign_chunks must be in 0..{self.chunks}, got {self.foreign_chunks}")
        if not 0.0 <= self.single_token_word_share <= 1.0:
            raise ValueError(f"single_token_word_share must be in [0, 1], got {self.single_token_word_share}")

    @property
    def in_world(self) -> bool:
        return self.foreign_chunks == 0

    def to_dict(self) -> dict[str, Any]:
        return {"chunks": self.chunks, "foreign_chunks": self.foreign_chunks,
                "single_token_word_share": round(self.single_token_word_share, 4)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CorpusFit:
        return cls(int(data["chunks"]), int(data["foreign_chunks"]), float(data["single_token_word_share"]))


class WorldCheck:
    """Counts the single-token words of texts under one tokenizer (a transformers tokenizer or anything callable the
    same way), each distinct word tokenized once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._single: dict[str, bool] = {}

    def _learn(self, words: Iterable[str]) -> None:
        new = sorted({word for word in words if word not in self._single})
        if not new:
            return
        # a word as it appears inside a sentence: after a space
        ids = self.tokenizer([" " + word for word in new], add_special_tokens=False)["input_ids"]
        self._single.update((word, len(pieces) == 1) for word, pieces in zip(new, ids))

    def counts(self, text: str) -> tuple[int, int]:
        """(single-token words, words) of `text`."""
        words = _WORD.findall(text)
        self._learn(words)
        return sum(self._single[word] for word in words), len(words)

    def is_foreign(self, text: str) -> bool:
        """True when fewer than `IN_WORLD_WORD_SHARE` of the text's words are single tokens (no words: False)."""
        single, words = self.counts(text)
        return words > 0 and single < IN_WORLD_WORD_SHARE * words

    def fit(self, texts: Iterable[str]) -> CorpusFit:
        """The `CorpusFit` of chunk texts."""
        chunks = foreign = single_total = word_total = 0
        for text in texts:
            single, words = self.counts(text)
            chunks += 1
            foreign += words > 0 and single < IN_WORLD_WORD_SHARE * words
            single_total += single
            word_total += words
        return CorpusFit(chunks, foreign, single_total / word_total if word_total else 1.0)
