"""`--cache-format` end to end over a real index (tiny model, real LMDB, real FAISS): precompute rebuilds an index's
cache in another format (manifest, namespace, old entries removed), `cache stats` shows the formats held, ask and
serve refuse another format than the index's in one line (exit 3), calibrate records the smallest format meeting
its KL target, and bad names are one-line errors (exit 2). The command line's `main` runs in this process."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from hypic_rag.entry.compression import CACHE_FORMATS
from cli_support import run_here  # tests/cli/cli_support.py


def one_line(done: subprocess.CompletedProcess[str], command: str, code: int) -> str:
    assert done.returncode == code, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hypic-rag {command}: error: "), done.stderr
    return lines[0]


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory, copy_tiny_index) -> Path:
    return copy_tiny_index(tmp_path_factory.mktemp("format_cli") / "index")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kits.corpora import SMALL_CORPUS, write_corpus

    return write_corpus(tmp_path_factory.mktemp("format_corpus") / "corpus", SMALL_CORPUS)


def manifest(index: Path) -> dict:
    return json.loads((index / "manifest.json").read_text())


def stats(capsys, index: Path) -> dict:
    done = run_here(capsys, "cache", "stats", "--cache", str(index / "segment_cache"), "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("command", ["precompute", "ask", "serve", "calibrate"])
def test_an_unknown_format_is_one_line_and_exit_2(capsys, index: Path, corpus: Path, command: str) -> None:
    extra = {"precompute": [str(corpus)], "ask": ["question"], "serve": ["--port", "0"], "calibrate": []}[command]
    line = one_line(run_here(capsys, command, "--index", str(index), "--cache-format", "int2", *extra), command, 2)
    assert "--cache-format" in line and "unknown cache format 'int2'" in line


def test_precompute_rebuilds_the_cache_in_a_format_and_ask_and_serve_keep_it(
    capsys, index: Path, corpus: Path, tiny_model: Path
) -> None:
    assert manifest(index)["cache_format"] == "float32"
    before = stats(capsys, index)
    assert {(row["cache_format"], row["seam_tokens"]) for row in before["namespaces"]} == {("float32", 8), ("float32", 0)}
    done = run_here(capsys, "precompute", str(corpus), "--index", str(index), "--model", str(tiny_model),
                    "--device", "cpu", "--no-progress", "--chunk-tokens", "96", "--cache-format", "int8")
    assert done.returncode == 0, done.stderr
    assert "cache format: int8, rebuilt from float32 (" in done.stdout
    assert manifest(index)["cache_format"] == "int8"
    after = stats(capsys, index)
    assert {row["cache_format"] for row in after["namespaces"]} == {"int8"}  # the float32 entries were removed
    assert after["entries"] == before["entries"] and after["value_bytes"] < 0.45 * before["value_bytes"]
    text = run_here(capsys, "cache", "stats", "--cache", str(index / "segment_cache"))
    assert "formats         int8 (" in text.stdout
    again = run_here(capsys, "precompute", str(corpus), "--index", str(index), "--model", str(tiny_model),
                     "--device", "cpu", "--no-progress", "--chunk-tokens", "96")  # keeps its format: nothing to do
    assert again.returncode == 0 and "index is up to date" in again.stdout and "cache format: int8\n" in again.stdout

    asked = run_here(capsys, "ask", "--index", str(index), "--device", "cpu", "--top-k", "3", "--max-new-tokens", "2",
                     "--json", "Who keeps bees?")
    assert asked.returncode == 0, asked.stderr
    usage = json.loads(asked.stdout)["usage"]
    assert usage["cache_hits"] >= 3 and usage["cache_misses"] == 0  # the int8 entries, decoded
    for command, extra in (("ask", ["--device", "cpu", "Who keeps bees?"]), ("serve", ["--port", "0"])):
        line = one_line(run_here(capsys, command, "--index", str(index), "--cache-format", "int4", *extra), command, 3)
        assert "keeps its cache entries in format int8, not int4" in line and "--cache-format int4" in line
    matching = run_here(capsys, "ask", "--index", str(index), "--device", "cpu", "--cache-format", "int8",
                        "--max-new-tokens", "1", "Who keeps bees?")
    assert matching.returncode == 0, matching.stderr


def test_the_python_api_takes_the_format_and_refuses_another(index: Path) -> None:
    from hypic_rag.pipeline.answering import RagPipeline
    from hypic_rag.retrieval.errors import IndexMismatchError
    from hypic_rag.server.config import ServerConfig
    from hypic_rag.pipeline.session import CacheConfig

    recorded = manifest(index)["cache_format"]
    other = "int4" if recorded != "int4" else "int8"
    with pytest.raises(IndexMismatchError, match=f"format {recorded}, not {other}"):
        RagPipeline.open(index, device="cpu", cache_format=other)
    pipeline = RagPipeline.open(index, device="cpu", cache_format=recorded)
    try:
        assert pipeline.session.segment_source.stats()["cache_format"] == recorded
    finally:
        pipeline.close()
    with pytest.raises(ValueError, match="unknown cache format"):
        ServerConfig(index_dir=index, cache_format="int2")
    with pytest.raises(ValueError, match="unknown cache format"):
        CacheConfig(cache_format="float64")


def test_calibrate_records_the_smallest_format_meeting_its_target(capsys, tmp_path: Path, index: Path) -> None:
    questions = tmp_path / "questions.txt"
    questions.write_text("Where does the river flow?\nWho keeps bees?\n")
    common = ["calibrate", "--index", str(index), "--device", "cpu", "--questions", str(questions), "--top-k", "3",
              "--candidates", "seam", "--cache-format", "int8,int4,bfloat16"]
    loose = run_here(capsys, *common, "--format-kl-target", "1000", "--dry-run", "--json")
    assert loose.returncode == 0, loose.stderr
    choice = json.loads(loose.stdout)["cache_format_choice"]
    assert choice["cache_format"] == "int4" and choice["met"]  # the smallest of the three
    assert [row["cache_format"] for row in choice["candidates"]] == ["int4", "int8", "bfloat16"]  # by bytes
    assert all(0 <= row["mean_kl"] <= row["p99_kl"] + 1e-12 <= row["max_kl"] + 2e-12 for row in choice["candidates"])
    assert manifest(index).get("cache_format_choice") is None  # a dry run records nothing
    strict = run_here(capsys, *common, "--format-kl-target", "0")
    assert strict.returncode == 0, strict.stderr
    assert "Format float32 (float32) is kept" in strict.stdout
    recorded = manifest(index)
    assert recorded["cache_format_choice"]["cache_format"] == "float32"
    assert not recorded["cache_format_choice"]["met"] and recorded["cache_format_choice"]["requests"] == 2
    assert recorded["cache_format"] in CACHE_FORMATS  # the index's own format is unchanged by calibration


def test_cache_formats_lists_every_registered_format(capsys) -> None:
    done = run_here(capsys, "cache", "formats", "--json")
    assert done.returncode == 0
    rows = json.loads(done.stdout)["formats"]
    assert [row["name"] for row in rows] == list(CACHE_FORMATS)
    bits = {row["name"]: row["state_bits_per_value"] for row in rows}
    assert bits["float32"] == 32 and bits["int8"] == 8.125 and bits["int4"] == 4.5
