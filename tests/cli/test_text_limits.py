"""Text a user gives the command line is bounded as the server bounds it: a question of more than 4,000 characters
(argument or standard input), a lone surrogate (argv bytes that are not UTF-8, a JSON `"\\ud800"` in a questions
file), a line of megabytes in `calibrate --questions`: each is one line naming the limit, exit 2, before any model
loads (they were an 80-line traceback, 24 GB of memory until the kernel killed it, and a 7 GB allocation)."""

from __future__ import annotations

import io
import json
import os
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from hypic_rag.cli import main as cli_main
from hypic_rag.errors import EXIT_BAD_INPUT
from hypic_rag.utils.limits import MAX_QUESTION_CHARS


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory, copy_tiny_index: Callable[[Path], Path]) -> Path:
    return copy_tiny_index(tmp_path_factory.mktemp("text_limits") / "index")


def one_line(arguments: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli_main.main(arguments) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    return captured.err


def test_ask_refuses_a_question_over_the_limit_from_standard_input_without_reading_it_all(
    index: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    stdin = io.StringIO("Where does the river flow? " * 3_734)  # 100,818 characters
    monkeypatch.setattr("sys.stdin", stdin)
    line = one_line(["ask", "--index", str(index), "-"], capsys)
    assert f"more than {MAX_QUESTION_CHARS} characters" in line and line.startswith("hypic-rag ask: error: ")
    assert stdin.tell() <= MAX_QUESTION_CHARS + 1  # the rest of the input was never read


@pytest.mark.parametrize(("question", "reason"), [
    ("x" * (MAX_QUESTION_CHARS + 1), f"has {MAX_QUESTION_CHARS + 1} characters; at most {MAX_QUESTION_CHARS}"),
    ("Where is " + os.fsdecode(b"\xff") + "?", "lone surrogate"),
    ("   ", "is empty"),
])
def test_ask_refuses_a_bad_question_argument(index: Path, capsys: pytest.CaptureFixture[str], question: str,
                                             reason: str) -> None:
    assert reason in one_line(["ask", "--index", str(index), question], capsys)


@pytest.mark.parametrize(("content", "reason"), [
    (json.dumps({"question": "\ud800"}).encode() + b"\n", ":1: the question holds a lone surrogate"),
    (b"Who keeps bees?\n" + json.dumps({"question": "Who? \udfff"}).encode(), ":2: the question holds a lone surrogate"),
    (b"Who keeps bees?\n" + b"a" * (5 << 20) + b"\n", ":2: the line is longer than 32000 bytes"),
    (b"Who keeps bees?\n" + b"a" * (MAX_QUESTION_CHARS + 1) + b"\n", f":2: the question has {MAX_QUESTION_CHARS + 1}"),
    (b"Who keeps \xff bees?\n", ":1: not UTF-8 text (byte 10)"),
    (json.dumps({"question": 3}).encode(), ':1: a JSON line needs a non-empty "question" string'),
])
def test_calibrate_checks_every_question_of_its_file_before_the_model_loads(
    index: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, reason: str
) -> None:
    questions = tmp_path / "questions.txt"
    questions.write_bytes(content)
    tracemalloc.start()
    try:
        line = one_line(["calibrate", "--index", str(index), "--questions", str(questions), "--dry-run"], capsys)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert f"{questions}{reason}" in line, line
    assert peak < 4 << 20  # a 5 MB line is never read whole (it grew to 24 GB)


def test_calibrate_reads_only_the_questions_it_uses(index: Path, tmp_path: Path) -> None:
    from hypic_rag.calibration.index import read_questions

    questions = tmp_path / "questions.txt"
    questions.write_bytes(b"First?\nSecond?\n" + b"\xff" * 10)  # the damaged tail lies past what is used
    assert read_questions(questions, limit=2) == ["First?", "Second?"]


def test_the_library_pipeline_has_the_same_limit(index: Path) -> None:
    from hypic_rag.pipeline.answering import PipelineError, RagPipeline

    pipeline = RagPipeline.open(index, device="cpu")
    try:
        with pytest.raises(PipelineError, match=f"has {MAX_QUESTION_CHARS + 1} characters; at most {MAX_QUESTION_CHARS}"):
            pipeline.prepare("x" * (MAX_QUESTION_CHARS + 1))
        with pytest.raises(PipelineError, match="lone surrogate"):
            pipeline.prepare("Who \ud800?")
        assert pipeline.prepare("x" * MAX_QUESTION_CHARS, top_k=1).request.question_ids
    finally:
        pipeline.close()
