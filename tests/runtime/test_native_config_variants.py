"""`load_model(..., implementation="auto")` never builds a model that answers differently from transformers.

A table of config.json variants of one shrunken Qwen3.5 checkpoint (rotary keys absent, at the top level, legacy,
null; the activation; layer-type patterns; missing layer weights) written on disk: for each, "auto" either builds
natively with transformers' rotary table and logits (1e-5 of transformers' own forward) or falls back to
transformers, with the fingerprint of the build it used; a config transformers rejects is one `ModelLoadError`
line (through the command line too: exit code 2, one stderr line, no traceback).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hypic_rag.cli.in_process import run_cli_here
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.model import ModelLoadError, load_model
from hypic_rag.runtime.checkpoints.native import unsupported_reason
from hypic_rag.testing import save_tiny_checkpoint
from kits.corpora import random_request

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Gramux Mastem is an astronomer.", "Numbers: 12 345 6789."]

Edit = Callable[[dict[str, Any]], None]


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    return config["rope_parameters"]


def _move_to_top(key: str) -> Edit:
    def edit(config: dict[str, Any]) -> None:
        config[key] = _rope(config).pop(key)
    return edit


def _drop(key: str) -> Edit:
    def edit(config: dict[str, Any]) -> None:
        _rope(config).pop(key)
    return edit


def _set(**values: Any) -> Edit:
    def edit(config: dict[str, Any]) -> None:
        config.update(values)
    return edit


def _legacy_linear(config: dict[str, Any]) -> None:
    config["rope_scaling"] = {"type": "linear", "factor": 2.0, "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    del config["rope_parameters"]


def _scaling_beside(theta: float) -> Edit:
    def edit(config: dict[str, Any]) -> None:
        config["rope_scaling"] = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.5}
    return edit


def _layer_types(kinds: list[str]) -> Edit:
    return _set(layer_types=kinds)


LAYERS = 4
"""The base checkpoint's layers: linear, linear, linear, full (rope_theta 10000, partial_rotary_factor 0.5)."""

VARIANTS: dict[str, tuple[Edit, str]] = {
    # name: (config edit, what "auto" must do: "native", "transformers" or "error")
    "as written": (lambda config: None, "native"),
    "other theta and factor": (_set(rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                     "partial_rotary_factor": 0.25}), "native"),
    "partial_rotary_factor absent": (_drop("partial_rotary_factor"), "transformers"),
    "partial_rotary_factor at top level": (_move_to_top("partial_rotary_factor"), "transformers"),
    "rope_theta absent": (_drop("rope_theta"), "transformers"),
    "rope_theta at top level": (_move_to_top("rope_theta"), "transformers"),
    "rope_parameters null": (_set(rope_parameters=None), "transformers"),
    "legacy rope_scaling linear": (_legacy_linear, "transformers"),
    "rope_scaling beside rope_parameters": (_scaling_beside(10000.0), "transformers"),
    "rope_scaling with another theta": (_scaling_beside(300.0), "transformers"),
    "hidden_act gelu": (_set(hidden_act="gelu"), "transformers"),
    "layer_types shorter": (_layer_types(["linear_attention", "linear_attention", "full_attention"]), "error"),
    "layer_types longer": (_layer_types(["linear_attention"] * 3 + ["full_attention"] * 2), "error"),
    "layer_types another pattern than the weights'": (_layer_types(["full_attention", "linear_attention",
                                                                    "linear_attention", "full_attention"]), "error"),
    # transformers reads the legacy name "mamba" as "linear_attention": only transformers' build reads it so
    "layer_types with a legacy name": (_layer_types(["linear_attention", "mamba", "linear_attention",
                                                     "full_attention"]), "transformers"),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(
        tmp_path_factory.mktemp("variants") / "base", TEXTS, seed=5, tie_word_embeddings=False,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_hidden_layers=LAYERS,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )


def variant(base: Path, directory: Path, edit: Edit) -> Path:
    path = Path(shutil.copytree(base, directory))
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_the_base_checkpoint_is_as_the_table_says(base: Path) -> None:
    config = json.loads((base / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    assert config["layer_types"][-1] == "full_attention" and config["num_hidden_layers"] == LAYERS
    assert config["hidden_act"] == "silu" and "rope_scaling" not in config and "rope_theta" not in config


@pytest.mark.parametrize("name", list(VARIANTS))
def test_auto_builds_natively_only_what_equals_transformers(
    base: Path, tmp_path: Path, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    edit, expected = VARIANTS[name]
    path = variant(base, tmp_path / "checkpoint", edit)
    if expected == "error":
        for implementation in ("auto", "native", "transformers"):
            with pytest.raises(ModelLoadError) as raised:
                load_model(path, device="cpu", implementation=implementation)
            assert len(str(raised.value).splitlines()) == 1
        return
    with caplog.at_level(logging.INFO, logger="hypic_rag.runtime.model"):
        chosen = load_model(path, device="cpu")
    reference = load_model(path, device="cpu", implementation="transformers")
    assert chosen.implementation == expected, unsupported_reason(path)
    fallbacks = [record.getMessage() for record in caplog.records if "through transformers" in record.getMessage()]
    assert len(fallbacks) == (expected == "transformers")  # one line saying why, only on a fallback
    assert chosen.fingerprint == reference.fingerprint  # what the index records is the build's own
    if expected == "native":  # the rotary table transformers builds, not one read from the file another way
        ours = chosen.hf_model.model.rotary_emb.inv_freq
        theirs = reference.hf_model.model.rotary_emb.inv_freq
        assert ours.shape == theirs.shape and torch.equal(ours, theirs)
    vocab = reference.config.vocab_size
    for seed in range(2):
        request = random_request(torch.Generator().manual_seed(seed), [9, 12], vocab=vocab)
        ids = torch.tensor([request.all_ids()])
        with torch.no_grad():
            expected_logits = reference.hf_model(input_ids=ids, use_cache=False).logits[0, -1].float()
        logits = Engine(chosen, seam_tokens=3).prefill(request, "full").logits
        torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=0)


def test_weights_missing_for_a_declared_layer_are_refused_in_one_line(base: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = Path(shutil.copytree(base, tmp_path / "missing"))
    tensors = load_file(path / "model.safetensors")
    dropped = sorted(name for name in tensors if name.startswith("model.layers.2.linear_attn."))
    assert dropped
    save_file({name: tensor for name, tensor in tensors.items() if name not in dropped}, path / "model.safetensors",
              metadata={"format": "pt"})
    for implementation in ("auto", "native", "transformers"):
        with pytest.raises(ModelLoadError) as raised:
            load_model(path, device="cpu", implementation=implementation)
        message = str(raised.value)
        assert len(message.splitlines()) == 1 and dropped[0] in message, message


@pytest.mark.parametrize("name", ["layer_types shorter", "layer_types longer"])
def test_the_command_line_says_it_in_one_line(
    base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    path = variant(base, tmp_path / "checkpoint", VARIANTS[name][0])
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(" ".join(TEXTS))
    capsys.readouterr()
    done = run_cli_here("precompute", str(corpus), "--index", str(tmp_path / "index"), "--model", str(path),
                    "--device", "cpu", "--no-progress")
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hypic-rag precompute: error: "), done.stderr
    assert "Traceback" not in done.stderr and "layer" in lines[0]


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next", "olmo_hybrid", "kimi_linear", "bailing_hybrid"])
def test_the_linear_layers_conv_takes_the_configs_activation(model_type: str) -> None:
    """Gated DeltaNet and KDA apply `config.hidden_act` after their short conv in transformers: so does the runtime
    (it used SiLU whatever the config said: 1.4e-3 off with "gelu")."""
    from hypic_rag.runtime.model import wrap_model
    from hypic_rag.testing import build_tiny_model

    model = wrap_model(build_tiny_model(model_type, seed=2, hidden_act="gelu"))
    assert model.config.hidden_act == "gelu"
    request = random_request(torch.Generator().manual_seed(1), [9, 12], vocab=model.config.vocab_size)
    with torch.no_grad():
        expected = model.hf_model(input_ids=torch.tensor([request.all_ids()]), use_cache=False).logits[0, -1].float()
    logits = Engine(model, seam_tokens=3).prefill(request, "full").logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
