"""The command line starts light: `--help`, `--version` and every command's `--help` import none of the heavy
libraries (torch, transformers, sentence-transformers, LlamaIndex, FAISS, numpy, FastAPI, Ray); they load only when
a command uses them. Checked on the modules a real process imported (`python -X importtime`), never by timing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "sentence_transformers", "llama_index", "faiss", "numpy", "fastapi", "ray",
         "sklearn", "scipy")


def imported_modules(*code_or_argv: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run `python -X importtime ARGV` from this checkout; the top-level names of every module it imported."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-X", "importtime", *code_or_argv], capture_output=True, text=True,
                            timeout=120, env=env, cwd=REPO)
    names = set(re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*([\w.]+)\s*$", result.stderr, re.M))
    return result, {name.split(".")[0] for name in names}


def test_help_and_version_import_nothing_heavy() -> None:
    for argv in (["--help"], ["--version"]):
        result, modules = imported_modules("-m", "hypic_rag", *argv)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "hypic_rag" in modules  # the parse did run
        assert not modules & set(HEAVY), f"hypic-rag {argv[0]} imported {sorted(modules & set(HEAVY))}"


def test_every_command_help_imports_nothing_heavy() -> None:
    code = (
        "import argparse, contextlib, io, sys\n"
        "from hypic_rag.cli.main import build_parser\n"
        "parser = build_parser()\n"
        "commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices\n"
        "for name, sub in commands.items():\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        sub.parse_args(['--help'])\n"
        "print(sorted(commands))\n"
    )
    result, modules = imported_modules("-c", code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ask" in result.stdout and "precompute" in result.stdout and "serve" in result.stdout
    assert not modules & set(HEAVY), f"a command's --help imported {sorted(modules & set(HEAVY))}"
