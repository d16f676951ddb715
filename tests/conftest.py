"""Shared fixtures. Tests run offline on CPU with tiny random models.

Built once per test run: `tiny_model` (the tiny random checkpoint of `kits.corpora.tiny_model_checkpoint`)
and the tiny index of `SMALL_CORPUS`, which a module gets as its own copy through `copy_tiny_index` (a server or a
CLI writes to the index it uses: its segment cache, its documents), so no module sees another's writes.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (spinning threads: 10x slower)

import logging  # noqa: E402
import shutil  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# two threads in one pytest process; one per worker when pytest-xdist runs two (`make test` does: `-n 2`)
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, torch.get_num_threads())))
logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random qwen3_5 checkpoint whose tokenizer was trained on the small corpus (read-only)."""
    from kits.corpora import tiny_model_checkpoint

    return tiny_model_checkpoint(tmp_path_factory.getbasetemp() / "hypic_tiny_model")


@pytest.fixture(scope="session")
def tiny_index_master(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """`SMALL_CORPUS` precomputed with `tiny_model` (96-token chunks, 8 seam tokens). Never opened by a test:
    tests take copies (`copy_tiny_index`)."""
    from kits.corpora import SMALL_CORPUS, build_index

    return build_index(tmp_path_factory.mktemp("tiny_index") / "index", tiny_model, SMALL_CORPUS)


@pytest.fixture(scope="session")
def copy_tiny_index(tiny_index_master: Path) -> Callable[[Path], Path]:
    """A function that copies the run's tiny index (with its segment cache) to a new directory and returns it."""

    def copy(destination: Path) -> Path:
        return Path(shutil.copytree(tiny_index_master, destination))

    return copy
