"""`hypic-rag precompute` and `ask` (the CLI's `main` in this process; the real processes run once, in
tests/e2e/test_families_end_to_end.py) on stand-ins of Mamba-family hub checkpoints in their published layout: the
CLI drives them unchanged."""

from __future__ import annotations

import pytest
from ssm_checks import check_precompute_and_ask, corpus_tokenizer

from hypic_rag.testing.ssm import save_published_ssm_checkpoint


@pytest.mark.parametrize("kind", ["jamba", "falcon_h1"])
def test_precompute_and_ask_on_a_published_checkpoint(kind: str, tmp_path) -> None:
    directory, _ = save_published_ssm_checkpoint(tmp_path / "model", corpus_tokenizer(), kind=kind)
    check_precompute_and_ask(directory, tmp_path)
