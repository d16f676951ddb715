"""The embedder's light paths against their references: `PooledTransformer` against sentence-transformers on the
shipped MiniLM directory and on copies of it with other pooling modes; its transformers-free backend (`BatchTokenizer`
+ `BertEncoder`) against its transformers backend (`AutoTokenizer` + `AutoModel`) there and on tiny random BERTs;
and which directories take which path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import torch
from safetensors.torch import load_file, save_file

from hypic_rag.runtime.checkpoints.batch_tokenizer import BatchTokenizer
from hypic_rag.runtime.checkpoints.bert_encoder import load_bert_encoder
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
    assert isinstance(embedder.model, PooledTransformer) and embedder.model.backend == "light"
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


def test_embedding_imports_neither_sentence_transformers_nor_transformers() -> None:
    code = ("import sys; from hypic_rag.retrieval.embeddings import SentenceEmbedder; "
            "vector = SentenceEmbedder().embed_query('What is the hobby of Gramux Mastem?'); "
            "print(vector.shape, 'sentence_transformers' in sys.modules, 'transformers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "(384,) False False"


def test_the_light_backend_equals_the_transformers_backend_on_the_shipped_embedder() -> None:
    model_dir = default_embedder_path()
    stack = PooledStack.read(model_dir)
    assert stack is not None
    light = PooledTransformer(model_dir, stack, backend="light")
    reference = PooledTransformer(model_dir, stack, backend="transformers")
    assert light.backend == "light" and reference.backend == "transformers"
    stripped = [text.strip() for text in TEXTS]
    input_ids, attention_mask = light.batch_tokenizer(stripped)
    features = reference.tokenizer(stripped, padding=True, truncation="longest_first", max_length=256,
                                   return_tensors="pt")
    assert torch.equal(input_ids, features["input_ids"]) and torch.equal(attention_mask, features["attention_mask"])
    assert input_ids.shape[1] == 256  # tokenizer.json's own limit (128) is replaced by the stack's
    assert attention_mask[1].sum() == 2  # the empty text: [CLS] [SEP]
    with torch.inference_mode():
        hidden = light.encoder(input_ids, attention_mask)
        expected = reference.model(**features).last_hidden_state
    real = attention_mask.bool()
    torch.testing.assert_close(hidden[real], expected[real], atol=1e-5, rtol=0)
    for batch_size in (1, 3, len(TEXTS)):
        np.testing.assert_allclose(light.encode(TEXTS, batch_size), reference.encode(TEXTS, batch_size), atol=1e-6)


@pytest.mark.parametrize("lengths", ["equal", "mixed"])
def test_a_text_embeds_the_same_in_any_batch_as_alone(lengths: str) -> None:
    """The light backend packs a batch's real tokens through its products (padding only inside attention): every
    text's vector in a batch equals its vector alone (1e-6), for batches with padding and batches whose texts have
    the same token count (no padding: each text must still attend to its own tokens only)."""
    import random

    embedder = SentenceEmbedder().load()
    assert embedder.model.backend == "light"
    rng = random.Random(5)
    words = "Gramux Mastem works for Kestrel Works in the north of Ilvara since 1979 , a cat sat".split()
    if lengths == "equal":  # one token per word: every text 2 + 6 tokens
        common = "the cat sat on a mat in north of dog ran far".split()
        texts = [" ".join(rng.choice(common) for _ in range(6)) for _ in range(12)]
        ids, mask = embedder.model.batch_tokenizer(texts)
        assert bool(mask.all()), "the texts must tokenize to the same length"
    else:
        texts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 40))) for _ in range(12)]
    alone = np.stack([embedder.embed([text])[0] for text in texts])
    for size in (2, 5, 12):
        picks = rng.sample(range(len(texts)), size)
        np.testing.assert_allclose(embedder.embed([texts[i] for i in picks]), alone[picks], atol=1e-6)


TINY_WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "a", "cat", "dog", "sat", "on", "mat", "##s",
              "##ing", "run", ".", ",", "!", "数", "字"]
TINY_TEXTS = ["the cats sat on the mat.", "", "dogs running, running, running on a mat! " * 4, "数字 é ?", "a"]


def tiny_bert(directory: Path, architecture: str, **changes: object) -> Any:
    """A random BERT (every weight random, LayerNorms included) of `architecture` saved with its tokenizer in
    `directory`; the transformers model is returned."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=len(TINY_WORDS), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=48, max_position_embeddings=40,
                                     **changes)
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.3)
    model.save_pretrained(directory)
    vocabulary = {word: number for number, word in enumerate(TINY_WORDS)}
    transformers.BertTokenizer(vocab=vocabulary).save_pretrained(directory)
    return model


@pytest.mark.parametrize("architecture", ["BertModel", "BertForMaskedLM"])  # names as written, and `bert.`-prefixed
def test_the_bert_encoder_equals_transformers_on_a_tiny_random_bert(tmp_path: Path, architecture: str) -> None:
    model = tiny_bert(tmp_path, architecture)
    bert = model if architecture == "BertModel" else model.bert
    stack = PooledStack(max_seq_length=16, pooling="mean")
    light = PooledTransformer(tmp_path, stack, backend="light")
    reference = PooledTransformer(tmp_path, stack, backend="transformers")
    input_ids, attention_mask = light.batch_tokenizer(TINY_TEXTS)
    features = reference.tokenizer(TINY_TEXTS, padding=True, truncation="longest_first", max_length=16,
                                   return_tensors="pt")
    assert torch.equal(input_ids, features["input_ids"]) and torch.equal(attention_mask, features["attention_mask"])
    assert input_ids.shape[1] == 16 and (input_ids == 1).any()  # truncated; unknown words
    with torch.inference_mode():
        hidden = light.encoder(input_ids, attention_mask)
        expected = bert(**features).last_hidden_state
    assert hidden.dtype == torch.float32 and hidden.shape == (len(TINY_TEXTS), 16, 32)
    real = attention_mask.bool()
    torch.testing.assert_close(hidden[real], expected[real], atol=1e-5, rtol=0)
    np.testing.assert_allclose(light.encode(TINY_TEXTS, 2), reference.encode(TINY_TEXTS, 2), atol=1e-5)


@pytest.mark.parametrize("changes", [{"hidden_act": "gelu_new"}, {"position_embedding_type": "relative_key"},
                                     {"is_decoder": True}])
def test_other_berts_fall_back_to_transformers(tmp_path: Path, changes: dict[str, object]) -> None:
    tiny_bert(tmp_path, "BertModel")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    assert load_bert_encoder(tmp_path) is None
    stack = PooledStack(max_seq_length=16, pooling="mean")
    with pytest.raises(ValueError, match="plain BERT"):
        PooledTransformer(tmp_path, stack, backend="light")
    assert PooledTransformer(tmp_path, stack).backend == "transformers"


def test_missing_or_foreign_files_fall_back_to_transformers(tmp_path: Path) -> None:
    tiny_bert(tmp_path, "BertModel")
    assert load_bert_encoder(tmp_path) is not None and BatchTokenizer.read(tmp_path, 16) is not None
    settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**settings, "padding_side": "left"}))
    assert BatchTokenizer.read(tmp_path, 16) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["encoder.layer.1.output.dense.bias"]
    save_file(tensors, tmp_path / "model.safetensors")
    assert load_bert_encoder(tmp_path) is None
    (tmp_path / "model.safetensors").unlink()
    assert load_bert_encoder(tmp_path) is None
