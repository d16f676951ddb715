"""kimi_linear, bailing_hybrid, olmo_hybrid and minimax checkpoints in their published layout (shrunken stand-ins:
config keys as published, per-expert MoE tensors, q / k / v convs as three tensors, renamed modules, sharded
safetensors with an index) load with `load_model` and run; `precompute` and `ask` (the CLI's `main`) run on one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.model import load_model
from hypic_rag.runtime.request import Request
from kits.corpora import SMALL_CORPUS, SMALL_CORPUS_QUESTIONS, write_corpus
from kits.published import save_linear_family_checkpoint
from hypic_rag.cli.in_process import run_cli_here

TEXTS = (list(SMALL_CORPUS.values()) + list(SMALL_CORPUS_QUESTIONS.values())) * 4

PUBLISHED_NAMES = {  # tensors of layer 1 (a linear layer) that only the published layout has
    "kimi_linear": ("model.layers.1.self_attn.q_conv1d.weight", "model.layers.1.self_attn.A_log",
                    "model.layers.1.self_attn.f_a_proj.weight", "model.layers.1.block_sparse_moe.experts.0.w1.weight",
                    "model.layers.1.block_sparse_moe.gate.e_score_correction_bias"),
    "bailing_hybrid": ("model.word_embeddings.weight", "model.layers.1.attention.v_conv1d.weight",
                       "model.layers.1.attention.dense.weight", "model.layers.1.attention.f_proj.weight",
                       "model.layers.1.mlp.experts.3.up_proj.weight", "model.layers.1.mlp.gate.expert_bias"),
    "olmo_hybrid": ("model.layers.1.attention_layer_norm.weight", "model.layers.1.feedforward_layer_norm.weight",
                    "model.layers.1.linear_attn.k_conv1d.weight"),
    "minimax": ("model.layers.1.block_sparse_moe.experts.2.w2.weight", "model.layers.1.block_sparse_moe.gate.weight",
                "model.layers.1.self_attn.qkv_proj.weight"),
}
RUNTIME_ONLY = ("conv1d.weight", "forget_gate", "experts.gate_up_proj", "experts.down_proj", "slope_rate")
"""Name parts of transformers' in-memory layout that a published checkpoint does not have (`q_conv1d.weight`
ends with `conv1d.weight` too: checked as a whole-word part below)."""


@pytest.fixture(scope="module", params=tuple(PUBLISHED_NAMES))
def published(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    directory, instance = save_linear_family_checkpoint(tmp_path_factory.mktemp(request.param), TEXTS,
                                                        model_type=request.param)
    return request.param, directory, instance


def test_stand_in_has_the_published_layout(published) -> None:
    model_type, directory, instance = published
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == model_type and config["architectures"] == [type(instance).__name__]
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) == 2 and all((directory / name).is_file() for name in weight_map.values())
    names = set(weight_map)
    assert set(PUBLISHED_NAMES[model_type]) <= names
    assert not any(part in name.split(".") or name.endswith("." + part) for name in names for part in RUNTIME_ONLY)


def test_load_model_reads_the_published_layout(published) -> None:
    model_type, directory, instance = published
    model = load_model(directory, device="cpu", require_tokenizer=True)
    assert model.config.model_type == model_type and model.tokenizer is not None
    assert model.layer_types == tuple(instance.config.layer_types)
    ids = torch.randint(3, len(model.tokenizer), (60,), generator=torch.Generator().manual_seed(0)).tolist()
    request = Request(ids[:4], [ids[4:24], ids[24:41], ids[41:53]], ids[53:])
    with torch.no_grad():
        expected = instance(torch.tensor([request.all_ids()]), use_cache=False).logits[0, -1]
    engine = Engine(model, seam_tokens=4)
    torch.testing.assert_close(engine.prefill(request, "full").logits, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(engine.prefill(request, "hypic", seam_tokens=20).logits, expected, atol=1e-4, rtol=1e-4)
    assert load_model(directory, device="cpu").fingerprint == model.fingerprint


def test_precompute_and_ask_run_on_a_minimax_stand_in(tmp_path: Path) -> None:
    """`hypic-rag precompute` encodes every chunk (lightning layers: scalar transitions, empty conv tails) into the
    index's segment cache and `ask` answers from it (the CLI's `main` in this process; the real `python -m hypic_rag`
    processes on a published stand-in run once, in tests/e2e/test_families_end_to_end.py)."""
    directory, _ = save_linear_family_checkpoint(tmp_path / "model", TEXTS, model_type="minimax", seed=1)
    corpus = write_corpus(tmp_path / "corpus", SMALL_CORPUS)
    index = tmp_path / "index"
    done = run_cli_here("precompute", str(corpus), "--index", str(index), "--model", str(directory),
                        "--chunk-tokens", "48", "--no-progress", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    question = SMALL_CORPUS_QUESTIONS["volcano.md"]
    done = run_cli_here("ask", "--index", str(index), "--device", "cpu", "--max-new-tokens", "4", question)
    assert done.returncode == 0, done.stderr
    assert "volcano.md" in done.stdout and ", 0 encoded" in done.stdout, done.stdout
