"""Loading models: an exact fingerprint at any thread count; Qwen3.5 hub checkpoints
in their published layout (shrunken stand-ins: multimodal config, `model.language_model.*`, a vision tower, `mtp.*`
weights, fused MoE experts, sharded safetensors with an index file) loaded as a directory or as a
`...ForConditionalGeneration` instance; `--dtype` on precompute, ask and serve; model directories that cannot be
loaded give one line and exit 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hypic_rag.cache.keys import CacheNamespace
from hypic_rag.cli.main import main
from hypic_rag.cli.common import DTYPE_CHOICES
from hypic_rag.demo.default_model import default_model_path
from hypic_rag.retrieval.manifest import IndexManifest
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.model import DTYPES, ModelLoadError, load_model, wrap_model
from hypic_rag.runtime.request import Request
from kits.corpora import SMALL_CORPUS, SMALL_CORPUS_QUESTIONS, build_index, write_corpus
from hypic_rag.testing import build_tiny_model
from kits.published import PUBLISHED_KINDS, save_published_checkpoint

TEXTS = (list(SMALL_CORPUS.values()) + list(SMALL_CORPUS_QUESTIONS.values())) * 4
QUESTION = SMALL_CORPUS_QUESTIONS["volcano.md"]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def a_request(vocab: int) -> Request:
    ids = torch.randint(3, vocab, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    return Request(ids[:4], [ids[4:24], ids[24:41], ids[41:53]], ids[53:])


# ---------------------------------------------------------------------------------------------------------- fingerprint


@pytest.mark.skipif(not (default_model_path() / "config.json").is_file(), reason="bundled model missing")
def test_fingerprint_is_exact_at_any_thread_count() -> None:
    """The bundled model is large enough that a float sum of its tensors differs between 1 and 2 threads (the old
    digest added it: fingerprints 0ae09ca3924c with 1 thread, 85344772a5f7 with 2); the fingerprint does not."""
    hf_model = load_model(default_model_path(), device="cpu").hf_model
    tensors = list(hf_model.state_dict().values())
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        sums_one, fingerprint_one = [float(t.float().sum()) for t in tensors], wrap_model(hf_model).fingerprint
        torch.set_num_threads(2)
        sums_two, fingerprint_two = [float(t.float().sum()) for t in tensors], wrap_model(hf_model).fingerprint
    finally:
        torch.set_num_threads(threads)
    assert sums_one != sums_two  # the premise: float reductions depend on the thread count here
    assert fingerprint_one == fingerprint_two


def test_any_changed_weight_changes_the_fingerprint() -> None:
    model = build_tiny_model("qwen3_5", seed=0)
    before = load_model(model, device="cpu").fingerprint
    weight = model.model.layers[0].mlp.up_proj.weight
    with torch.no_grad():
        weight.view(-1)[1] = torch.nextafter(weight.view(-1)[1], torch.tensor(2.0))  # 1 ulp, outside the sample
    assert load_model(model, device="cpu").fingerprint != before


# ---------------------------------------------------------------------------------------------- the caller's object


@pytest.mark.parametrize("model_type", ["qwen3_5", "granitemoehybrid"])
def test_loading_a_model_object_leaves_it_as_it_was(model_type: str) -> None:
    """`load_model(obj)` changes nothing in `obj` (the same module objects of the same classes, its training flag,
    its weights) and its own forward gives the very logits it gave before (it used to run our oneDNN linears
    afterwards: every "transformers' forward" baseline measured after loading ran them); the runtime drives a view
    over the same weights and still equals transformers' forward."""
    from hypic_rag.runtime.fast_linear import ONEDNN, FastLinear

    hf_model = build_tiny_model(model_type, seed=2).train()
    modules = [(name, module, type(module)) for name, module in hf_model.named_modules()]
    weights = {name: tensor.clone() for name, tensor in hf_model.state_dict().items()}
    ids = torch.randint(3, 200, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = hf_model.eval()(ids, use_cache=False).logits[0]
    hf_model.train()

    model = load_model(hf_model, device="cpu")
    assert model.hf_model is hf_model and model.runtime_model is not hf_model
    assert [(name, module, type(module)) for name, module in hf_model.named_modules()] == modules
    assert all(module.training for module in hf_model.modules())
    assert not any(module.training for module in model.runtime_model.modules())
    assert (sum(type(module) is FastLinear for module in model.runtime_model.modules()) > 0) == ONEDNN
    assert {name: id(tensor) for name, tensor in model.runtime_model.state_dict(keep_vars=True).items()} == {
        name: id(tensor) for name, tensor in hf_model.state_dict(keep_vars=True).items()}  # shared, not copied
    with torch.no_grad():
        after = hf_model.eval()(ids, use_cache=False).logits[0]
    assert torch.equal(after, before)
    for name, tensor in hf_model.state_dict().items():
        assert torch.equal(tensor, weights[name])
    request = Request([], [], ids[0].tolist())
    full = Engine(model).prefill(request, "full").logits
    torch.testing.assert_close(full, before[-1], atol=1e-4, rtol=1e-4)


def test_loading_a_model_object_in_another_dtype_or_device_is_refused_not_converted() -> None:
    hf_model = build_tiny_model("qwen3_5", seed=2)
    with pytest.raises(ModelLoadError, match=r"cpu float32, not cpu bfloat16.*model\.to\(device, dtype\)"):
        load_model(hf_model, dtype="bfloat16")
    with pytest.raises(ModelLoadError, match="not meta float32"):
        load_model(hf_model, device="meta")
    assert all(parameter.dtype == torch.float32 and parameter.device.type == "cpu"
               for parameter in hf_model.parameters())
    assert load_model(hf_model, device="cpu", dtype=torch.float32).hf_model is hf_model


# ------------------------------------------------------------------------------------------------ published checkpoints


@pytest.fixture(scope="module", params=PUBLISHED_KINDS)
def published(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    directory, instance = save_published_checkpoint(tmp_path_factory.mktemp(request.param), TEXTS, kind=request.param)
    return request.param, directory, instance


def test_stand_in_has_the_published_layout(published) -> None:
    kind, directory, _ = published
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration" if kind.endswith("moe") else
                                       "Qwen3_5ForConditionalGeneration"]
    assert config["model_type"] == kind and config["text_config"]["model_type"] == f"{kind}_text"
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) == 2 and all((directory / name).is_file() for name in weight_map.values())
    assert not (directory / "model.safetensors").exists()
    names = set(weight_map)
    assert "model.language_model.embed_tokens.weight" in names and "lm_head.weight" in names
    assert any(name.startswith("model.visual.blocks.0.") for name in names)
    assert any(name.startswith("mtp.layers.0.") for name in names) and "mtp.fc.weight" in names
    assert not any(name.startswith("model.layers.") for name in names)
    if kind == "qwen3_5_moe":  # experts pre-fused per layer, no per-expert tensors
        assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in names
        assert "model.language_model.layers.0.mlp.experts.down_proj" in names
        assert not any(".experts.0." in name for name in names)


def test_directory_and_conditional_generation_instance_load_the_same_text_stack(published) -> None:
    _, directory, instance = published
    from_directory = load_model(directory, device="cpu")
    # the instance: a multimodal model whose decoder is model.language_model (failed with "'Qwen3_5Model' object
    # has no attribute 'embed_tokens'")
    from_instance = load_model(instance, device="cpu", tokenizer=from_directory.tokenizer)
    assert type(from_instance.hf_model).__name__.endswith("ForConditionalGeneration")
    assert from_instance.fingerprint == from_directory.fingerprint  # text config and text stack only
    assert from_instance.layer_types == from_directory.layer_types

    request = a_request(len(from_directory.tokenizer))
    ids = torch.tensor([request.all_ids()])
    with torch.no_grad():
        expected = instance(input_ids=ids, use_cache=False).logits[0, -1]
    for model in (from_directory, from_instance):
        torch.testing.assert_close(Engine(model).prefill(request, "full").logits, expected, atol=1e-4, rtol=1e-4)
    hypic = [Engine(model, seam_tokens=4).prefill(request, "hypic").logits for model in (from_directory, from_instance)]
    assert torch.equal(hypic[0], hypic[1])

    with torch.no_grad():  # the vision tower is outside the fingerprint; the text stack is inside
        instance.model.visual.blocks[0].mlp.linear_fc1.weight.add_(1.0)
        assert load_model(instance, device="cpu").fingerprint == from_directory.fingerprint
        instance.model.language_model.norm.weight.add_(1.0)
        assert load_model(instance, device="cpu").fingerprint != from_directory.fingerprint
        instance.model.language_model.norm.weight.sub_(1.0)
        instance.model.visual.blocks[0].mlp.linear_fc1.weight.sub_(1.0)


def test_dtype_is_part_of_the_model_identity_and_cache_namespace(published) -> None:
    _, directory, _ = published
    models = {name: load_model(directory, device="cpu", dtype=name) for name in DTYPES}
    assert {name: model.dtype_name for name, model in models.items()} == {name: name for name in DTYPES}
    assert len({model.fingerprint for model in models.values()}) == len(DTYPES)
    namespaces = {name: CacheNamespace.for_model(model, 8) for name, model in models.items()}
    assert {namespace.model_dtype for namespace in namespaces.values()} == set(DTYPES)
    assert len({namespace.digest() for namespace in namespaces.values()}) == len(DTYPES)
    request = a_request(len(models["bfloat16"].tokenizer))
    entry = Engine(models["bfloat16"], seam_tokens=4).encode_segment(request.segments[0])
    assert entry["layers.3.key"].dtype == torch.bfloat16
    assert set(DTYPE_CHOICES) == set(DTYPES)
    with pytest.raises(ValueError, match="not supported"):
        load_model(directory, device="cpu", dtype="int8")


# ---------------------------------------------------------------------------------------------- --dtype through the CLI


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory, _ = save_published_checkpoint(tmp_path_factory.mktemp("moe"), TEXTS, kind="qwen3_5_moe", seed=1)
    return directory


@pytest.fixture(scope="module")
def bf16_index(tmp_path_factory: pytest.TempPathFactory, moe_checkpoint: Path) -> Path:
    work = tmp_path_factory.mktemp("bf16")
    corpus = write_corpus(work / "corpus", SMALL_CORPUS)
    code = main(["precompute", str(corpus), "--index", str(work / "index"), "--model", str(moe_checkpoint),
                 "--dtype", "bfloat16", "--chunk-tokens", "96", "--no-progress", "--device", "cpu"])
    assert code == 0
    return work / "index"


def test_precompute_ask_and_serve_run_in_the_dtype_the_index_records(
    bf16_index: Path, moe_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hypic_rag.server.backend import ServiceBackend
    from hypic_rag.server.config import ServerConfig

    manifest = IndexManifest.load(bf16_index)
    assert manifest.model.dtype == "bfloat16"
    assert manifest.model.fingerprint == load_model(moe_checkpoint, device="cpu", dtype="bfloat16").fingerprint

    code, out, err = run_cli(capsys, "ask", "--index", str(bf16_index), "--device", "cpu", QUESTION)
    assert code == 0, err
    assert "volcano.md" in out and ", 0 encoded" in out  # ran in bfloat16 (the recorded dtype): every entry hit
    code, out, err = run_cli(capsys, "ask", "--index", str(bf16_index), "--device", "cpu", "--dtype", "bfloat16",
                             QUESTION)
    assert code == 0 and ", 0 encoded" in out, err
    code, _, err = run_cli(capsys, "ask", "--index", str(bf16_index), "--device", "cpu", "--dtype", "float32", QUESTION)
    assert code == 3 and err.count("\n") == 1
    assert "built for model" in err and "in bfloat16, not float32" in err and "--dtype bfloat16" in err
    code, _, err = run_cli(capsys, "precompute", str(bf16_index.with_name("corpus")), "--index", str(bf16_index),
                           "--model", str(moe_checkpoint), "--chunk-tokens", "96", "--no-progress", "--device", "cpu")
    assert code == 0, err  # rerun without --dtype: the index's dtype, nothing to do
    with pytest.raises(SystemExit) as exited:
        run_cli(capsys, "precompute", "corpus", "--index", "x", "--dtype", "int8")
    assert exited.value.code == 2 and "invalid choice: 'int8'" in capsys.readouterr().err

    backend = ServiceBackend.open(ServerConfig(index_dir=bf16_index, device="cpu", read_only=True))
    try:
        assert backend.pipeline.engine.model.dtype_name == "bfloat16"
        namespace = backend.pipeline.engine.segment_source.namespace
        assert namespace.model_dtype == "bfloat16"
    finally:
        backend.close()
    with pytest.raises(ValueError, match="not supported"):
        ServerConfig(index_dir=bf16_index, dtype="int8")
    with pytest.raises(SystemExit) as exited:
        run_cli(capsys, "serve", "--index", str(bf16_index), "--dtype", "double")
    assert exited.value.code == 2


def test_an_index_from_before_exact_fingerprints_is_adopted_once(
    tmp_path: Path, moe_checkpoint: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A manifest written before this release records a thread-count-dependent fingerprint and no dtype: `ask` and
    `precompute` accept it for the same checkpoint and tokenizer (its old cache entries simply miss), precompute
    records the exact identity once."""
    index = build_index(tmp_path / "index", moe_checkpoint, SMALL_CORPUS)
    manifest_file = index / "manifest.json"
    data = json.loads(manifest_file.read_text())
    current = dict(data["model"])
    data["model"].pop("dtype")
    data["model"]["fingerprint"] = "85344772a5f7" + "0" * 52
    manifest_file.write_text(json.dumps(data))

    code, _, err = run_cli(capsys, "ask", "--index", str(index), "--device", "cpu", QUESTION)
    assert code == 0, err  # was exit 3 ("index was built for model ... (fingerprint 85344772a5f7) ...")
    precompute = ["precompute", str(index.with_name("index.corpus")), "--index", str(index), "--model",
                  str(moe_checkpoint), "--chunk-tokens", "96", "--no-progress", "--device", "cpu"]
    caplog.clear()
    code, _, err = run_cli(capsys, *precompute)
    assert code == 0, err
    assert json.loads(manifest_file.read_text())["model"] == current
    assert "predates exact model fingerprints" in caplog.text
    caplog.clear()
    code, out, _ = run_cli(capsys, *precompute)
    assert code == 0 and "index is up to date" in out and "predates" not in caplog.text  # once
    other = save_published_checkpoint(tmp_path / "other", TEXTS[:3], kind="qwen3_5")[0]
    data["model"]["path"] = str(other)
    manifest_file.write_text(json.dumps(data))
    code, _, err = run_cli(capsys, *precompute)
    assert code == 3 and "index was built for model" in err  # only the same checkpoint directory is adopted


# ----------------------------------------------------------------------------------- model directories that cannot load


def broken_copies(source: Path, root: Path) -> dict[str, tuple[Path, str]]:
    """Copies of a sharded checkpoint, each broken one way, with the phrase its error must contain."""

    def copy(name: str) -> Path:
        return Path(shutil.copytree(source, root / name))

    invalid_json = copy("invalid-json")
    (invalid_json / "config.json").write_text('{"model_type": "qwen3_5",\n')
    no_weights = copy("no-weights")
    for path in no_weights.glob("model*"):
        path.unlink()
    missing_shard = copy("missing-shard")
    (missing_shard / "model-00002-of-00002.safetensors").unlink()
    no_tokenizer = copy("no-tokenizer")
    for path in no_tokenizer.glob("tokenizer*"):
        path.unlink()
    damaged_shard = copy("damaged-shard")  # passes the cheap checks; safetensors refuses it while loading
    shard = damaged_shard / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:64])
    return {
        "invalid-json": (invalid_json, "config.json is not valid JSON"),
        "no-weights": (no_weights, "has no weights"),
        "missing-shard": (missing_shard, "model-00002-of-00002.safetensors"),
        "no-tokenizer": (no_tokenizer, "has no tokenizer files"),
        "damaged-shard": (damaged_shard, f"cannot load the model in '{damaged_shard}'"),
    }


def test_model_directories_that_cannot_load_give_one_line_and_exit_2(
    tmp_path: Path, bf16_index: Path, moe_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = str(bf16_index.with_name("corpus"))
    for name, (model, phrase) in broken_copies(moe_checkpoint, tmp_path).items():
        with pytest.raises(ModelLoadError, match=phrase.replace(".", r"\.")):
            load_model(model, device="cpu", require_tokenizer=True)
        for command in (
            ["precompute", corpus, "--index", str(tmp_path / f"index-{name}"), "--no-progress"],
            ["ask", "--index", str(bf16_index), QUESTION],
            ["serve", "--index", str(bf16_index), "--port", "0"],
        ):
            code, _, err = run_cli(capsys, *command, "--model", str(model), "--device", "cpu")
            assert code == 2 and err.count("\n") == 1 and phrase in err, (name, command[0], err)
            assert err.startswith(f"hypic-rag {command[0]}: error: ")
        assert not (tmp_path / f"index-{name}").exists()  # nothing created


def test_a_model_without_tokenizer_files_fails_in_a_real_process(tmp_path: Path, moe_checkpoint: Path,
                                                                 bf16_index: Path) -> None:
    """Was: `cannot encode an empty segment` (a tokenizer with an empty vocabulary was loaded)."""
    model = Path(shutil.copytree(moe_checkpoint, tmp_path / "model"))
    for path in model.glob("tokenizer*"):
        path.unlink()
    environment = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), OMP_WAIT_POLICY="PASSIVE")
    done = subprocess.run(
        [sys.executable, "-m", "hypic_rag", "precompute", str(bf16_index.with_name("corpus")), "--index",
         str(tmp_path / "index"), "--model", str(model), "--no-progress"],
        check=False, capture_output=True, text=True, timeout=300, env=environment,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        (f"hypic-rag precompute: error: model directory '{model}' has no tokenizer files (tokenizer.json, or "
         "vocab.json and merges.txt); copy the checkpoint's tokenizer files into it")
    ]
