"""`hypic-rag ARGV` run in this process, for tests whose subject is the command's output and exit code rather than
the process boundary (one real-process test per kind of path stays beside them)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
from pathlib import Path


def run_cli_here(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`main(ARGV)` in this process (optionally from directory CWD), as a CompletedProcess: its exit code (argparse's
    usage errors exit through SystemExit) and what it wrote to stdout and stderr, log records included (the root
    logger's handlers are set aside meanwhile, so that `main`'s `logging.basicConfig` writes to this stderr as it
    does in a fresh process)."""
    from hypic_rag.cli.main import main

    stdout, stderr = io.StringIO(), io.StringIO()
    previous = Path.cwd()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers = []
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = main(list(argv))
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
                if not isinstance(exit_.code, (int, type(None))):
                    print(exit_.code, file=stderr)
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers, root.level = handlers, level
        os.chdir(previous)
    return subprocess.CompletedProcess(list(argv), code, stdout.getvalue(), stderr.getvalue())
