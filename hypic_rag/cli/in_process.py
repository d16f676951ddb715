"""`hypic-rag ARGV` run in this process, for tests whose subject is the command's output and exit code rather than
the process boundary (one real-process test per kind of path stays beside them)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
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


_IN_CHILD = """
import json, sys
from hypic_rag.cli.in_process import run_cli_here
done = [run_cli_here(*argv) for argv in json.loads(sys.stdin.read())]
print(json.dumps([[result.returncode, result.stdout, result.stderr] for result in done]))
"""


def run_cli_in_one_child(
    *commands: Sequence[str], cwd: Path | None = None, timeout: float = 300,
    preexec_fn: Callable[[], None] | None = None,
) -> tuple[subprocess.CompletedProcess[str], list[subprocess.CompletedProcess[str]]]:
    """Each of COMMANDS (`hypic-rag` argv) through `main` in turn, all in ONE fresh `python` process (this checkout
    first on its path; optionally from directory CWD, PREEXEC_FN run before exec): for checks that need a process
    boundary (a signal death such as SIGBUS must not take the test runner with it; capabilities dropped at exec)
    but not one process per command. Returns the child (its exit code: negative for a signal) and, when it exited
    0, one CompletedProcess per command."""
    repository = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repository), os.environ.get("PYTHONPATH")])),
               OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    child = subprocess.run([sys.executable, "-c", _IN_CHILD], input=json.dumps([list(argv) for argv in commands]),
                           cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, preexec_fn=preexec_fn,
                           check=False)
    if child.returncode != 0:
        return child, []
    results = json.loads(child.stdout.strip().splitlines()[-1])
    return child, [subprocess.CompletedProcess(list(argv), code, out, err)
                   for argv, (code, out, err) in zip(commands, results)]
