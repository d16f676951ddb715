"""`--recompute-policy` on ask and serve, and `hypic-rag calibrate`, over a real index (tiny model): the command line's
`main` in this process (fast), and a real subprocess for the end of the calibrate -> ask path.

A bad value is one line `hypic-rag <command>: error: ...` and exit 2; calibrate records its choice in the manifest
and `ask` then uses it unless told another policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_support import run_here  # tests/cli/cli_support.py

REPOSITORY = Path(__file__).resolve().parents[2]


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    """`python -m hypic_rag ARGV` in a subprocess, this checkout first on the path."""
    env = {**os.environ, "PYTHONPATH": str(REPOSITORY), "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run([sys.executable, "-m", "hypic_rag", *argv], capture_output=True, text=True, env=env,
                          timeout=300, check=False, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory, copy_tiny_index) -> Path:
    return copy_tiny_index(tmp_path_factory.mktemp("policy_cli") / "index")


def one_line_error(done: subprocess.CompletedProcess[str], command: str) -> str:
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hypic-rag {command}: error: "), done.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["ask", "serve"])
@pytest.mark.parametrize("value", ["bogus", "whole:0", "budget:0.5", "seam:3"])
def test_a_bad_policy_is_one_line_and_exit_2(capsys, index: Path, command: str, value: str) -> None:
    extra = ["question"] if command == "ask" else ["--port", "0"]
    line = one_line_error(run_here(capsys, command, "--index", str(index), "--recompute-policy", value, *extra), command)
    assert "--recompute-policy" in line


@pytest.mark.parametrize("argv", [["--kl-target", "-1"], ["--kl-target", "nan"], ["--candidates", "seam,nope"],
                                  ["--requests", "0"]])
def test_calibrate_rejects_bad_options_in_one_line(capsys, index: Path, argv: list[str]) -> None:
    one_line_error(run_here(capsys, "calibrate", "--index", str(index), *argv), "calibrate")


def test_calibrate_without_an_index_or_with_an_empty_question_file(capsys, tmp_path: Path, index: Path) -> None:
    assert "no index" in one_line_error(run_here(capsys, "calibrate", "--index", str(tmp_path / "none")), "calibrate")
    empty = tmp_path / "questions.txt"
    empty.write_text("\n\n")
    assert "holds no questions" in one_line_error(
        run_here(capsys, "calibrate", "--index", str(index), "--questions", str(empty)), "calibrate")


def test_ask_answers_under_the_policy_it_is_given(capsys, index: Path) -> None:
    answers = {}
    for policy in ("seam", "whole:2", "budget:1000"):
        done = run_here(capsys, "ask", "--index", str(index), "--device", "cpu", "--top-k", "3", "--max-new-tokens", "2",
                   "--recompute-policy", policy, "--json", "Where does the river flow?")
        assert done.returncode == 0, done.stderr
        answers[policy] = json.loads(done.stdout)
    assert answers["seam"]["recompute_policy"] == "seam@8"
    assert answers["whole:2"]["recompute_policy"] == "whole:2@8"
    tokens = {policy: answer["usage"]["recomputed_tokens"] for policy, answer in answers.items()}
    # budget:1000 recomputes every chunk whole: all but the prefix
    assert tokens["seam"] < tokens["whole:2"] < tokens["budget:1000"]
    assert tokens["budget:1000"] == answers["budget:1000"]["usage"]["prompt_tokens"] - prefix_tokens(index)


def prefix_tokens(index: Path) -> int:
    from hypic_rag.prompting.layout import PromptFormat, tokenize_segment
    from transformers import AutoTokenizer

    manifest = json.loads((index / "manifest.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(manifest["model"]["path"], local_files_only=True)
    return len(tokenize_segment(tokenizer, PromptFormat.from_dict(manifest["prompt_format"]).prefix))


def test_calibrate_records_the_choice_and_ask_uses_it(capsys, tmp_path: Path, index: Path) -> None:
    questions = tmp_path / "questions.jsonl"
    questions.write_text('{"question": "Where does the river flow?"}\n{"question": "Who keeps bees?"}\n')
    dry = run_here(capsys, "calibrate", "--index", str(index), "--device", "cpu", "--questions", str(questions), "--top-k", "3",
              "--kl-target", "1000", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    # any candidate meets target 1000: the cheapest default, anchored entries without a seam (the question alone)
    assert json.loads(dry.stdout)["policy"] == "seam@0+anchored" and not json.loads(dry.stdout)["recorded"]
    assert "recompute_policy" not in json.loads((index / "manifest.json").read_text()) or \
        json.loads((index / "manifest.json").read_text())["recompute_policy"] is None
    # target 0: only recomputing every retrieved chunk whole (= full, up to round-off) comes close
    done = run_here(capsys, "calibrate", "--index", str(index), "--device", "cpu", "--questions", str(questions),
                    "--top-k", "3", "--kl-target", "0", "--candidates", "seam,whole:1,whole:3")
    assert done.returncode == 0, done.stderr
    assert "<- chosen" in done.stdout and "recorded in the index manifest" in done.stdout
    record = json.loads((index / "manifest.json").read_text())["recompute_policy"]
    assert record["policy"] == "whole:3" and record["requests"] == 2 and record["source"] == "questions"
    asked = run_here(capsys, "ask", "--index", str(index), "--device", "cpu", "--top-k", "3", "--max-new-tokens", "2", "--json",
                "Who keeps bees?")
    assert asked.returncode == 0, asked.stderr
    assert json.loads(asked.stdout)["recompute_policy"] == "whole:3@8"
    text = run("ask", "--index", str(index), "--device", "cpu", "--top-k", "3", "--max-new-tokens", "2",
               "Who keeps bees?")  # a real process reads the manifest on its own
    assert text.returncode == 0, text.stderr
    assert "(recompute policy whole:3@8)" in text.stdout


def test_calibrate_chooses_within_max_recompute(capsys, tmp_path: Path, index: Path) -> None:
    questions = tmp_path / "questions.txt"
    questions.write_text("Where does the river flow?\nWho keeps bees?\n")
    common = ["calibrate", "--index", str(index), "--device", "cpu", "--questions", str(questions), "--top-k", "3",
              "--kl-target", "0", "--candidates", "seam,whole:1,whole:3", "--dry-run", "--json"]
    free = json.loads(run_here(capsys, *common).stdout)
    capped = json.loads(run_here(capsys, *common, "--max-recompute", "1").stdout)
    assert free["policy"] == "whole:3" and "token_cap" not in free  # the lowest KL: every chunk whole
    seam = next(candidate for candidate in capped["candidates"] if candidate["spec"] == "seam")
    assert capped["policy"] == "seam" and capped["max_recompute"] == 1
    assert capped["token_cap"] == pytest.approx(seam["recomputed_tokens"])
    one_line_error(run_here(capsys, *common, "--max-recompute", "0.5"), "calibrate")
