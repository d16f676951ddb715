"""Every numeric option of every command has a stated range and is refused outside it: out of range, huge,
negative, non-numeric, non-finite and non-UTF-8 values are each one line naming the option and the range, exit 2
(the parser is walked, so an option added later without a range fails here). The recompute policy specs are walked
the same way, every kind and every number of a spec (a seam of 20 digits was a 65-line traceback)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hypic_rag.cli import main as cli_main
from hypic_rag.cli.cache_command import parse_size
from hypic_rag.errors import EXIT_BAD_INPUT
from hypic_rag.utils.limits import NumberRange

ROOT = Path(__file__).resolve().parents[2]
NOT_UTF8 = os.fsdecode(b"\xff\xfe")
"""What Python makes of argv bytes that are not UTF-8 (surrogate escapes)."""


def commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """(words that select it, parser) of every command and sub-command."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name), sub
                yield from commands(sub, (*prefix, name))


def numeric_options() -> list[tuple[tuple[str, ...], str, object]]:
    """(command words, option, its argparse type) of every option that takes a number."""
    found = []
    for words, parser in commands(cli_main.build_parser()):
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0:
                continue
            numeric_default = isinstance(action.default, (int, float)) and not isinstance(action.default, bool)
            typed = action.type is not None and (hasattr(action.type, "allowed") or action.type is parse_size)
            if numeric_default or typed or action.type in (int, float):
                found.append((words, action.option_strings[-1], action.type))
    return found


NUMERIC = numeric_options()


def refuse(arguments: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one stderr line of a usage error for `arguments` (exit 2)."""
    with pytest.raises(SystemExit) as exited:
        cli_main.main(arguments)
    assert exited.value.code == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    return captured.err


def test_the_walk_finds_the_options_of_every_command() -> None:
    names = {(words[0], option) for words, option, _ in NUMERIC}
    assert {("ask", "--top-k"), ("ask", "--max-new-tokens"), ("precompute", "--seam-tokens"), ("serve", "--port"),
            ("serve", "--request-timeout"), ("calibrate", "--kl-target"), ("demo", "--questions"),
            ("cache", "--budget")} <= names
    assert len(NUMERIC) >= 28


@pytest.mark.parametrize(("words", "option", "kind"), NUMERIC, ids=lambda value: str(value) if isinstance(value, str) else None)
def test_every_numeric_option_states_its_range_and_refuses_what_lies_outside(
    words: tuple[str, ...], option: str, kind: object, capsys: pytest.CaptureFixture[str]
) -> None:
    assert kind not in (int, float), f"{' '.join(words)} {option} takes a number without a range"
    if kind is parse_size:
        allowed_text, bad = "positive size below 8 EiB", ["0", "-1", "9" * 30 + "g", "1e400", "abc", NOT_UTF8]
    else:
        allowed: NumberRange = kind.allowed  # type: ignore[attr-defined]
        below = allowed.minimum if allowed.minimum_exclusive else allowed.minimum - 1
        allowed_text = allowed.describe()
        bad = [str(below), str(allowed.maximum + 1), "9" * 30, "-" + "9" * 30, "-5", "abc", "nan", "inf", "1e400",
               "", NOT_UTF8]
        if allowed.integer:
            bad.append("2.5")
    for value in bad:
        line = refuse([*words, f"{option}={value}"], capsys)
        assert f"argument {option}" in line and allowed_text in line, (value, line)
        assert line.startswith(f"hypic-rag {' '.join(words)}: error: ")


POLICY_SPECS = {
    "seam@65537": "0..65536",
    "seam@99999999999999999999": "0..65536",
    "seam@" + "9" * 5000: "0..65536",
    "whole:0": "1..4096",
    "whole:4097@8": "1..4096",
    "whole:99999999999999999999999": "1..4096",
    "budget:0.5": "1..10000",
    "budget:10001": "1..10000",
    "budget:1.5@70000": "0..65536",
    "tokens:0": "1..16777216",
    "tokens:16777217": "1..16777216",
    "seam@-1": "expected one of",
    "whole:-2": "expected one of",
    "whole:abc": "expected one of",
    "budget:nan": "expected one of",
    "seam@" + NOT_UTF8: "expected one of",
}


@pytest.mark.parametrize("spec", list(POLICY_SPECS), ids=lambda spec: spec[:24])
def test_every_number_of_a_policy_spec_is_checked_where_specs_are_read(spec: str,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    for words, option in ((["ask", "--index", "i", "q"], "--recompute-policy"), (["serve", "--index", "i"], "--recompute-policy"),
                          (["calibrate", "--index", "i"], "--candidates")):
        line = refuse([*words, option, spec], capsys)
        assert f"argument {option}" in line and POLICY_SPECS[spec] in line, line
        assert len(line) < 400, line  # a huge spec is quoted cut short


def test_non_utf8_argument_bytes_are_one_line_in_a_real_process(tmp_path: Path) -> None:
    """argv bytes that are not UTF-8, through a real process (decoded by Python with surrogate escapes)."""
    environment = dict(os.environ, PYTHONPATH=str(ROOT), OMP_WAIT_POLICY="PASSIVE")
    for arguments in ([b"--top-k", b"\xff"], [b"--recompute-policy", b"seam@\xff"],
                      [b"--recompute-policy", b"seam@99999999999999999999"]):
        done = subprocess.run([sys.executable.encode(), b"-m", b"hypic_rag", b"ask", b"--index", str(tmp_path).encode(),
                               *arguments, b"question"], capture_output=True, check=False, timeout=120, env=environment)
        assert done.returncode == EXIT_BAD_INPUT, done.stderr
        assert done.stderr.count(b"\n") == 1 and b"Traceback" not in done.stderr, done.stderr
