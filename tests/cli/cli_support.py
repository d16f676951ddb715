"""What the command-line tests share: running `hypic-rag ARGV` in this process."""

from __future__ import annotations

import subprocess

import pytest

from hypic_rag.cli.in_process import run_cli_here


def run_here(capsys: pytest.CaptureFixture[str], *argv: str) -> subprocess.CompletedProcess[str]:
    """`main(ARGV)` in this process, as a CompletedProcess (argparse's usage errors exit through SystemExit)."""
    capsys.readouterr()
    return run_cli_here(*argv)
