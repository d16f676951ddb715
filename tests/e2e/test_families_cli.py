"""`precompute` and `ask` unchanged on families other than Qwen: a checkpoint directory of each (tiny random
weights, trained tokenizer) through the CLI's `main` in this process (the real `python -m hypic_rag` processes run
once, in tests/e2e/test_families_end_to_end.py); `ask` serves every chunk from the cache precompute wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hypic_rag.testing import save_tiny_checkpoint
from kits.corpora import write_corpus
from hypic_rag.cli.in_process import run_cli_here

DOCUMENTS = {
    "ada.md": "Ada Lind was born in 1970 in the town of Orrin. She works for Kestrel Works as a welder.",
    "kestrel.md": "Kestrel Works is a shipyard based in Tarrow, on the southern coast.",
    "amber.md": "The Amber Kiln studio is based in Velm and fires its kilns twice a week.",
    "lune.md": "The river Lune flows north from the Varn mountains to the sea at Orrin.",
}
QUESTION = "Where is Kestrel Works based?"


@pytest.mark.parametrize("model_type", ["granitemoehybrid", "lfm2"])
def test_precompute_then_ask_from_the_cache(tmp_path: Path, model_type: str) -> None:
    model = save_tiny_checkpoint(tmp_path / "model", [*DOCUMENTS.values(), QUESTION] * 8, model_type=model_type)
    corpus = write_corpus(tmp_path / "corpus", DOCUMENTS)
    done = run_cli_here("precompute", str(corpus), "--index", str(tmp_path / "index"), "--model", str(model),
                        "--chunk-tokens", "24", "--device", "cpu", "--no-progress")
    assert done.returncode == 0, done.stderr
    done = run_cli_here("ask", QUESTION, "--index", str(tmp_path / "index"), "--max-new-tokens", "3", "--top-k", "2",
                        "--device", "cpu", "--json")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["mode"] == "hypic" and answer["finish_reason"] in ("length", "stop")
    usage = answer["usage"]
    assert usage["cached_tokens"] > 0 and usage["encoded_tokens"] == 0  # every chunk's entry came from the cache
