"""The embedder's light path (`PooledTransformer`: transformers alone) against sentence-transformers, its
reference, on the shipped MiniLM directory and on copies of it with other pooling modes; and which directories
take the light path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hypic_rag.retrieval.embeddings import PooledStack, PooledTransformer, SentenceEmbedder, default_embedder_path

TEXTS = [
    "What is the hobby of Gramux Mastem?",
    "",
    "   surrounded by spaces   ",
    "a long text " * 300,  # past the 256-token limit: truncated
    "Ünïcödé — with dashes, “quotes” and 数字 123",
    "short",
    "Gramux Mastem was born in 1979. Gramux Mastem is an astronomer by trade.",
]


def reference_vectors(model_dir: Path, texts: list[str], batch_size: int = 3) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
    return model.encode(texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True)


def copy_with_pooling(source: Path, destination: Path, mode: str) -> Path:
    """A copy of `source` (weights linked, not copied) whose pooling is `mode`."""
    destination.mkdir()
    for item in source.iterdir():
        if item.name != "1_Pooling":
            (destination / item.name).symlink_to(item)
    (destination / "1_Pooling").mkdir()
    config = json.loads((source / "1_Pooling" / "config.json").read_text())
    for key in [key for key in config if key.startswith("pooling_mode_")]:
        config[key] = key in (f"pooling_mode_{mode}_token", f"pooling_mode_{mode}_tokens")
    (destination / "1_Pooling" / "config.json").write_text(json.dumps(config))
    return destination


def test_the_shipped_embedder_takes_the_light_path_and_equals_sentence_transformers() -> None:
    model_dir = default_embedder_path()
    assert PooledStack.read(model_dir) == PooledStack(max_seq_length=256, pooling="mean")
    embedder = SentenceEmbedder(batch_size=3)
    vectors = embedder.embed(TEXTS)
    assert isinstance(embedder.model, PooledTransformer)
    assert vectors.dtype == np.float32 and vectors.shape == (len(TEXTS), embedder.dimension)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(vectors, reference_vectors(model_dir, TEXTS), atol=1e-6)
    np.testing.assert_allclose(embedder.embed_query(TEXTS[0]), vectors[0], atol=1e-6)  # alone = in a batch


@pytest.mark.parametrize("mode", ["cls", "max"])
def test_other_pooling_modes_equal_sentence_transformers(tmp_path: Path, mode: str) -> None:
    model_dir = copy_with_pooling(default_embedder_path(), tmp_path / mode, mode)
    assert PooledStack.read(model_dir) == PooledStack(max_seq_length=256, pooling=mode)
    vectors = SentenceEmbedder(model_dir, batch_size=3).embed(TEXTS)
    np.testing.assert_allclose(vectors, reference_vectors(model_dir, TEXTS), atol=1e-6)


def test_other_stacks_load_through_sentence_transformers(tmp_path: Path) -> None:
    two_modes = copy_with_pooling(default_embedder_path(), tmp_path / "two", "mean")
    config = json.loads((two_modes / "1_Pooling" / "config.json").read_text())
    config["pooling_mode_max_tokens"] = True  # mean and max concatenated: 768 dimensions
    (two_modes / "1_Pooling" / "config.json").write_text(json.dumps(config))
    assert PooledStack.read(two_modes) is None
    embedder = SentenceEmbedder(two_modes)
    assert embedder.dimension == 768 and not isinstance(embedder.model, PooledTransformer)
    np.testing.assert_allclose(embedder.embed(TEXTS[:2]), reference_vectors(two_modes, TEXTS[:2]), atol=1e-6)
    prompted = copy_with_pooling(default_embedder_path(), tmp_path / "prompted", "mean")
    (prompted / "config_sentence_transformers.json").unlink()
    (prompted / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": "query: "}, "default_prompt_name": "query"}))
    assert PooledStack.read(prompted) is None


def test_embedding_does_not_import_sentence_transformers() -> None:
    code = ("import sys; from hypic_rag.retrieval.embeddings import SentenceEmbedder; "
            "SentenceEmbedder().embed(['a question']); print('sentence_transformers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"
