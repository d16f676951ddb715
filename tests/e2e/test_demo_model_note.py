"""The bundled demo model says so when it answers outside its synthetic world (`hypic_rag.demo.world`), and only
then: `precompute` and `ask` print the note once, `ask --json` and `/v1/ask` carry it as `note`; over the example
corpus nothing is said."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from hypic_rag.demo.default_model import default_model_path, example_corpus_path
from hypic_rag.demo.world import DEMO_MODEL_NOTE, IN_WORLD_WORD_SHARE, WorldCheck, is_bundled_model

pytestmark = pytest.mark.skipif(not (default_model_path() / "config.json").is_file(), reason="bundled model missing")

FOREIGN_DOCUMENTS = {
    "brewery.md": "# Orion Brewing Cooperative\n\nThe Orion Brewing Cooperative was founded in Tartu in 1994 by Maret "
                  "Kask. It brews a pale lager and a smoked porter. Its head brewer, Jaan Tamm, trained in Bavaria.\n",
    "lighthouse.md": "# The Kelp Point lighthouse\n\nThe lighthouse at Kelp Point was automated in 1987. Its lamp is "
                     "visible for twenty nautical miles; the keeper's cottage is now a museum about shipwrecks.\n",
    "garden.md": "# Community garden rules\n\nPlots are assigned every March. Gardeners water their plots twice a "
                 "week during the summer and may not use chemical pesticides.\n",
}
QUESTION = "Who founded the Orion Brewing Cooperative?"


@pytest.fixture(scope="module")
def foreign_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    corpus = tmp_path_factory.mktemp("foreign_corpus")
    for name, text in FOREIGN_DOCUMENTS.items():
        (corpus / name).write_text(text, encoding="utf-8")
    return corpus


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)


def test_world_check_tells_the_synthetic_world_from_other_text(tokenizer) -> None:
    check = WorldCheck(tokenizer)
    examples = [path.read_text(encoding="utf-8") for path in sorted((example_corpus_path() / "documents").glob("*.md"))]
    fit = check.fit(examples)
    assert (fit.chunks, fit.foreign_chunks, fit.single_token_word_share) == (len(examples), 0, 1.0)
    assert fit.in_world
    foreign = check.fit(FOREIGN_DOCUMENTS.values())
    assert foreign.foreign_chunks == len(FOREIGN_DOCUMENTS) and not foreign.in_world
    assert foreign.single_token_word_share < IN_WORLD_WORD_SHARE
    assert not check.is_foreign("1994, 2001 -- 42.")  # no words: nothing to judge


def test_the_bundled_model_is_recognised_by_its_path_or_a_copy(tmp_path: Path, tiny_model: Path) -> None:
    assert is_bundled_model(default_model_path())
    copy = tmp_path / "copy"
    shutil.copytree(default_model_path(), copy)
    assert is_bundled_model(copy)
    assert not is_bundled_model(tiny_model)
    assert not is_bundled_model(tmp_path / "missing")


def run_cli(*arguments: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "hypic_rag", *arguments], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def test_precompute_and_ask_say_it_once_for_a_foreign_corpus(tmp_path: Path, foreign_corpus: Path) -> None:
    index = str(tmp_path / "index")
    precomputed = run_cli("precompute", str(foreign_corpus), "--index", index, "--no-progress")
    assert precomputed.stdout.splitlines().count(DEMO_MODEL_NOTE) == 1
    manifest = json.loads((tmp_path / "index" / "manifest.json").read_text())
    assert manifest["bundled_model_fit"]["foreign_chunks"] == manifest["bundled_model_fit"]["chunks"] > 0
    asked = run_cli("ask", "--index", index, QUESTION, "--timings")
    lines = asked.stdout.splitlines()
    assert lines.count(DEMO_MODEL_NOTE) == 1 and lines[0].startswith("Answer: ") and lines[1] == DEMO_MODEL_NOTE
    # --timings: where the whole run went, in one line
    assert re.fullmatch(r"Run: start-up [\d.]+ s \| imports [\d.]+ s \| model load [\d.]+ s \| index open [\d.]+ s \| "
                        r"embedder load [\d.]+ s \| answer [\d.]+ s \| total [\d.]+ s", lines[-1]), lines[-1]
    as_json = json.loads(run_cli("ask", "--index", index, QUESTION, "--json").stdout)
    assert as_json["note"] == DEMO_MODEL_NOTE
    timings = as_json["timings"]
    phases = ("startup", "imports", "model_load", "index_open", "embedder_load", "answer")
    assert all(timings[phase] >= 0 for phase in phases) and timings["time_to_first_token"] <= timings["answer"]
    assert sum(timings[phase] for phase in phases) <= timings["run_total"] + 0.05  # /proc's 10 ms ticks, rounding


def test_v1_ask_carries_the_note_over_a_foreign_index(tmp_path: Path, foreign_corpus: Path) -> None:
    from hypic_rag.server import ServerConfig
    from hypic_rag.server.runner import ServerThread
    from kits.corpora import build_index

    index = build_index(tmp_path / "index", default_model_path(), foreign_corpus, chunk_tokens=256)
    with ServerThread(ServerConfig(index_dir=index, device="cpu")) as server:
        response = httpx.post(f"{server.url}/v1/ask", json={"question": QUESTION, "max_new_tokens": 8}, timeout=300)
    assert response.status_code == 200, response.text
    assert response.json()["note"] == DEMO_MODEL_NOTE


def test_nothing_is_said_over_the_example_corpus(tmp_path: Path) -> None:
    from hypic_rag.pipeline.answering import RagPipeline
    from hypic_rag.pipeline.precompute import PrecomputeConfig, precompute
    from hypic_rag.runtime.sampling import SamplingParams

    summary = precompute(PrecomputeConfig(corpus=example_corpus_path() / "documents", index_dir=tmp_path / "index",
                                           model_path=default_model_path(), device="cpu", show_progress=False))
    assert summary.note is None
    pipeline = RagPipeline.open(tmp_path / "index", device="cpu")
    try:
        fit = pipeline.index.manifest.corpus_fit
        assert fit is not None and fit.in_world and fit.chunks == summary.chunks
        answer = pipeline.answer("What is the hobby of Gramux Mastem?", top_k=4, params=SamplingParams(max_new_tokens=4))
        assert answer.note is None and answer.as_dict()["note"] is None
        # a document added later, outside the world, is noticed in the answers that draw on it
        foreign = list(answer.sources)
        foreign[0].text = FOREIGN_DOCUMENTS["garden.md"]
        assert pipeline.note_for(foreign) == DEMO_MODEL_NOTE
    finally:
        pipeline.close()


def test_another_model_is_never_measured(tiny_index_master: Path) -> None:
    from hypic_rag.retrieval.manifest import IndexManifest

    assert IndexManifest.load(tiny_index_master).bundled_model_fit is None
