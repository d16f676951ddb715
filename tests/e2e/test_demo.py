"""`hypic-rag demo` end to end on the bundled model: builds its index once, answers under full and hypic."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from hypic_rag.demo.default_model import default_model_path

pytestmark = pytest.mark.skipif(not (default_model_path() / "config.json").is_file(), reason="bundled model missing")


def run_demo(cache_dir, *extra: str) -> subprocess.CompletedProcess:
    environment = dict(os.environ, HYPIC_RAG_CACHE=str(cache_dir))
    return subprocess.run(
        [sys.executable, "-m", "hypic_rag", "demo", "--questions", "2", *extra],
        capture_output=True, text=True, timeout=600, env=environment,
    )


def test_demo_builds_once_and_answers_side_by_side(tmp_path) -> None:
    first = run_demo(tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "precomputed 54 chunks" in first.stdout
    assert (tmp_path / "demo-index" / "manifest.json").is_file()
    answers = re.findall(r"^\s+(full|hypic)\s+-> .* TTFT\s+[\d.]+ ms, (\d+)/(\d+) tokens recomputed", first.stdout, re.M)
    assert [mode for mode, _, _ in answers] == ["full", "hypic"] * 2
    for mode, recomputed, prompt in answers:
        assert (int(recomputed) == int(prompt)) == (mode == "full")
    assert re.search(r"^exact match: full \d/2, hypic \d/2", first.stdout, re.M)
    second = run_demo(tmp_path)  # the index and cache are reused: nothing is precomputed again
    assert second.returncode == 0 and "precomputed" not in second.stdout


def test_demo_with_a_foreign_index_fails_in_one_line(tmp_path) -> None:
    (tmp_path / "not-an-index").mkdir()
    (tmp_path / "not-an-index" / "manifest.json").write_text("{broken")
    result = run_demo(tmp_path, "--index", str(tmp_path / "not-an-index"))
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and result.stderr.strip().count("\n") == 0
