"""What the command-line tests share: running `hypic-rag ARGV` in this process."""

from __future__ import annotations

import subprocess

import pytest

from hypic_rag.cli.main import main


def run_here(capsys: pytest.CaptureFixture[str], *argv: str) -> subprocess.CompletedProcess[str]:
    """`main(ARGV)` in this process, as a CompletedProcess (argparse's usage errors exit through SystemExit)."""
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(list(argv), code, captured.out, captured.err)
