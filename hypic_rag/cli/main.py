"""The `hypic-rag` command line: `main` parses the arguments and runs one command.

Each command lives in its own module with `register(subparsers)`. A command module registers a sub-parser and sets `func` on it; `func(args) -> int` returns the exit code.
Errors are mapped to exit codes here, once: any `HypicError` (the library's errors, and `CliError`, which a
command raises itself) prints one line `hypic-rag <command>: error: ...` and exits with the error's
`exit_code` (never a traceback). Output cut short by its reader (`hypic-rag cache stats --json | head`) ends
the command quietly with 141, as a tool killed by SIGPIPE; Ctrl-C with 130.

`hypic-rag`, `python -m hypic_rag` and `python -m hypic_rag.cli.main` all run `main`; the commands import what
they share from `hypic_rag.cli.common`, never from this module, so running it as `__main__` duplicates nothing.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import sys
from typing import NoReturn

from hypic_rag.version import __version__
from hypic_rag.cli.common import EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, CliError
from hypic_rag.errors import HypicError

__all__ = ["CliError", "build_parser", "main"]  # CliError: its home is hypic_rag.cli.common

# Before torch loads OpenMP: spinning worker threads slow every step whenever another process shares the cores
# (docs/runtime.md). An explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

COMMAND_MODULES = (  # in the order `hypic-rag --help` lists them: the way a new user meets them
    "hypic_rag.cli.demo_command",
    "hypic_rag.cli.precompute_command",
    "hypic_rag.cli.ask_command",
    "hypic_rag.cli.serve_command",
    "hypic_rag.cli.calibrate_command",
    "hypic_rag.cli.cache_command",
    "hypic_rag.cli.bench_command",
)

DESCRIPTION = """\
Answer questions over your documents with hybrid-attention LLMs (Qwen3.5, Qwen3-Next, Kimi-Linear, Granite 4.0-H,
Nemotron-H, Jamba, ...), fast: every chunk of your documents is encoded once into a cache, and each question reuses
the cached chunks instead of reading them again, recomputing only a few tokens at each chunk's start."""

EPILOG = """\
first steps:
  hypic-rag demo                                          see it work on the bundled example (about a minute)
  hypic-rag precompute DOCS --index DIR --model PATH      index a folder of .txt/.md/.jsonl/.pdf/.html/.docx files
  hypic-rag ask --index DIR "your question"               one question (loads the model each time)
  hypic-rag serve --index DIR                             many questions: a REST service that keeps the model loaded

Without --model the bundled demo model is used: a small model that knows only a synthetic world of invented people
and places, there to try the tool; for real answers pass a local checkpoint directory with --model.
`hypic-rag COMMAND --help` describes each command."""


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (`hypic-rag ask: error: ... (see --help)`), exit 2, as every other
    CLI error; sub-command parsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="hypic-rag", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hypic-rag {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on standard error")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, so that a closed pipe is noticed while it can still be handled
        return code
    except BrokenPipeError:
        # The reader went away (`| head`): print nothing more, and keep Python from complaining at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except HypicError as error:
        print(f"hypic-rag {args.command}: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print(f"hypic-rag {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def run() -> None:
    """The `hypic-rag` command: `main()`, then exit without collecting garbage.

    The interpreter's own shutdown runs the cycle collector over every object the imports made (torch's and
    transformers' module tables) after its output is printed (docs/verification.md). Nothing is
    left to flush or close by then (stores commit per write); freezing the heap skips that work.
    """
    code = main()
    gc.disable()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()
