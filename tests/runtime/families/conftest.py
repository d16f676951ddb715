"""Fixtures of the per-family test files, for the family their module names in `MODEL_TYPE`."""

from __future__ import annotations

import pytest
from family_modes import tiny_engine
from ssm_checks import corpus_tokenizer

from hypic_rag.testing.ssm import save_published_ssm_checkpoint


@pytest.fixture(scope="module")
def tiny(request: pytest.FixtureRequest):
    """(the family's tiny random model, an engine over it with a seam of 4): `family_modes.tiny_engine`."""
    return tiny_engine(request.module.MODEL_TYPE)


@pytest.fixture(scope="module")
def published(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(directory, instance) of a Mamba-family stand-in checkpoint in its published layout."""
    kind = request.module.MODEL_TYPE
    return save_published_ssm_checkpoint(tmp_path_factory.mktemp(kind), corpus_tokenizer(), kind=kind)
