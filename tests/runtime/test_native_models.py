"""The natively built Qwen3.5 (`runtime.native`) against the same checkpoint loaded through transformers: same
fingerprint, same blocks, same logits and tokens, transformers' own forward as the reference; and a native load
imports neither transformers nor torch._dynamo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hypic_rag.demo.default_model import default_model_path
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.model import CONFIG_DIGEST_IGNORED, ModelLoadError, load_model
from hypic_rag.runtime.checkpoints.native import qwen3_5
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.testing import save_tiny_checkpoint
from kits.corpora import random_request
from kits.published import save_published_checkpoint

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Gramux Mastem is an astronomer.", "Numbers: 12 345 6789."]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The bundled model; a random text checkpoint with untied embeddings written by save_pretrained; a shrunken hub
    checkpoint (multimodal config, text stack under model.language_model.*, bf16 shards)."""
    base = tmp_path_factory.mktemp("native")
    untied = save_tiny_checkpoint(base / "untied", TEXTS, seed=3, tie_word_embeddings=False)
    published, _ = save_published_checkpoint(base / "published", TEXTS, kind="qwen3_5", seed=4)
    return {"bundled": default_model_path(), "untied": untied, "published": published}


@pytest.mark.parametrize("name", ["bundled", "untied", "published"])
def test_native_build_equals_transformers(checkpoints: dict[str, Path], name: str) -> None:
    path = checkpoints[name]
    native = load_model(path, device="cpu", implementation="native")
    reference = load_model(path, device="cpu", implementation="transformers")
    assert native.implementation == "native" and reference.implementation == "transformers"
    assert load_model(path, device="cpu").implementation == "native"  # "auto" takes it
    assert native.fingerprint == reference.fingerprint
    assert native.layer_types == reference.layer_types and native.eos_token_ids == reference.eos_token_ids
    if name == "bundled":  # every key that changes outputs is transformers' (the version that wrote the file aside)
        native_config, reference_config = native.config.to_dict(), reference.config.to_dict()
        assert {key: value for key, value in native_config.items() if key not in CONFIG_DIGEST_IGNORED} == {
            key: reference_config.get(key) for key in native_config if key not in CONFIG_DIGEST_IGNORED}
    native_state, reference_state = native.hf_model.state_dict(), reference.hf_model.state_dict()
    text_names = {key.replace("model.language_model.", "model.") for key in reference_state
                  if not key.startswith(("model.visual.", "mtp."))}
    assert set(native_state) == text_names

    vocab = native.config.vocab_size
    for seed in range(2):
        request = random_request(torch.Generator().manual_seed(seed), [11, 7, 13], vocab=vocab)
        ids = torch.tensor([request.all_ids()])
        with torch.no_grad():
            expected = reference.hf_model(input_ids=ids, use_cache=False).logits[0, -1].float()
        for mode in ("full", "hypic"):
            native_logits = Engine(native, seam_tokens=3).prefill(request, mode).logits
            reference_logits = Engine(reference, seam_tokens=3).prefill(request, mode).logits
            torch.testing.assert_close(native_logits, reference_logits, atol=1e-6, rtol=1e-6)
            if mode == "full":
                torch.testing.assert_close(native_logits, expected, atol=5e-2 if name == "published" else 1e-4,
                                           rtol=1e-3)  # published: bf16 weights, different summation orders
        params = SamplingParams(max_new_tokens=6)
        tokens = [Engine(model, seam_tokens=3).generate(request, "hypic", params).token_ids
                  for model in (native, reference)]
        assert tokens[0] == tokens[1]


def test_text_config_keys_and_defaults_are_transformers() -> None:
    """The keys a native text config must hold and the defaults it fills are those of transformers' class: a new
    transformers that adds a key or changes a default fails here (fingerprints would differ otherwise)."""
    from transformers import Qwen3_5TextConfig

    defaults = Qwen3_5TextConfig().to_dict()
    assert set(qwen3_5.TEXT_CONFIG_KEYS) == set(defaults) - set(CONFIG_DIGEST_IGNORED)
    assert {key: defaults[key] for key in qwen3_5.TEXT_CONFIG_DEFAULTS} == qwen3_5.TEXT_CONFIG_DEFAULTS


def test_unsupported_checkpoints_fall_back_or_say_why(tmp_path: Path) -> None:
    path = save_tiny_checkpoint(tmp_path / "kimi", TEXTS, model_type="kimi_linear")
    assert load_model(path, device="cpu").implementation == "transformers"
    with pytest.raises(ModelLoadError, match="no native implementation here: model type 'kimi_linear'"):
        load_model(path, device="cpu", implementation="native")
    lacking = save_tiny_checkpoint(tmp_path / "lacking", TEXTS)
    config = json.loads((lacking / "config.json").read_text())
    del config["rms_norm_eps"], config["linear_conv_kernel_dim"]  # transformers' defaults; shapes unchanged
    (lacking / "config.json").write_text(json.dumps(config))
    assert load_model(lacking, device="cpu").implementation == "transformers"
    with pytest.raises(ModelLoadError, match="lacks linear_conv_kernel_dim, rms_norm_eps"):
        load_model(lacking, device="cpu", implementation="native")
    with pytest.raises(ValueError, match="implementation 'fast' is not one of auto, native, transformers"):
        load_model(lacking, implementation="fast")


def test_damaged_weights_are_one_line_errors(tmp_path: Path) -> None:
    path = save_tiny_checkpoint(tmp_path / "damaged", TEXTS)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="cannot load the model in"):
        load_model(path, device="cpu", implementation="native")


def test_native_model_has_no_forward_of_its_own() -> None:
    model = load_model(default_model_path(), device="cpu", implementation="native")
    with pytest.raises(NotImplementedError, match="implementation='transformers'"):
        model.hf_model(torch.tensor([[1, 2]]))


def test_native_load_imports_neither_transformers_nor_dynamo() -> None:
    code = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from hypic_rag.runtime.checkpoints.native import load_native\n"
        "from hypic_rag.demo.default_model import default_model_path\n"
        "load_native(default_model_path(), device=torch.device('cpu'), dtype=torch.float32)\n"
        "print(sorted(name for name in ('transformers', 'torch._dynamo') if name in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"
