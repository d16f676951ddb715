"""`python -m hypic_rag precompute` and `ask` (real subprocesses) on stand-ins of Mamba-family hub checkpoints in
their published layout: the CLI drives them unchanged."""

from __future__ import annotations

import pytest
from ssm_checks import check_precompute_and_ask, corpus_tokenizer

from hypic_rag.testing.ssm import save_published_ssm_checkpoint


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["jamba", "falcon_h1"])
def test_precompute_and_ask_on_a_published_checkpoint(kind: str, tmp_path) -> None:
    directory, _ = save_published_ssm_checkpoint(tmp_path / "model", corpus_tokenizer(), kind=kind)
    check_precompute_and_ask(directory, tmp_path)
