"""`--help` speaks to users and says what the code does: the tool and its commands in user terms (no developer
notes), the formats precompute reads, and the way to many questions (serve)."""

from __future__ import annotations

import pytest

from hypic_rag.retrieval.loading import CORPUS_SUFFIXES

from cli_support import run_here  # tests/cli/cli_support.py

COMMANDS = ("demo", "precompute", "ask", "serve", "calibrate", "cache", "bench")


def test_main_help_describes_the_tool_and_its_commands(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_here(capsys, "--help")
    assert result.returncode == 0
    text = result.stdout
    assert text.index("Answer questions over your documents") < text.index("positional arguments")
    positions = [text.index(f"    {command} ") for command in COMMANDS]
    assert positions == sorted(positions)  # listed in the order a new user meets them
    assert "first steps:" in text and "hypic-rag serve --index DIR" in text and "--model" in text
    for developer_word in ("register(", "subparsers", "module", "entry point"):
        assert developer_word not in text, developer_word


def test_precompute_help_names_every_format_the_loader_reads(capsys: pytest.CaptureFixture[str]) -> None:
    text = " ".join(run_here(capsys, "precompute", "--help").stdout.split())
    for suffix in (".txt", ".md", ".jsonl", ".pdf", ".html", ".docx"):
        assert suffix in CORPUS_SUFFIXES and suffix in text, suffix


def test_ask_help_points_to_serve_for_many_questions(capsys: pytest.CaptureFixture[str]) -> None:
    text = " ".join(run_here(capsys, "ask", "--help").stdout.split())
    assert "hypic-rag serve" in text and "--timings" in text


def test_serve_help_states_the_workers_auto_rule(capsys: pytest.CaptureFixture[str]) -> None:
    from hypic_rag.distributed.local_workers import MAX_AUTO_WORKERS, SMALL_MODEL_BYTES

    text = " ".join(run_here(capsys, "serve", "--help").stdout.split())
    assert "--workers N|auto" in text and "auto (the default)" in text and "--threads N" in text
    for part in ("one worker per core", f"at most {MAX_AUTO_WORKERS}", "os.sched_getaffinity",
                 f"{SMALL_MODEL_BYTES >> 20} MiB", "cores // workers intra-op threads", "worker-0 owns the index",
                 "The log names the choice and why"):
        assert part in text, part
