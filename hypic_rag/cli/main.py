"""`hypic-rag` entry point. Each command lives in its own module with `register(subparsers)`.

A command module registers a sub-parser and sets `func` on it; `func(args) -> int` returns the exit code.
User errors raise `CliError`, which prints one line and exits with its code (never a traceback); a cache or
retrieval error a command does not map itself prints one line and exits 1. Output cut short by its reader
(`hypic-rag cache stats --json | head`) ends the command quietly with 141, as a tool killed by SIGPIPE.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import NoReturn

from hypic_rag import __version__

# Before torch loads OpenMP: spinning worker threads slow every step ~10x whenever another process shares the
# cores (measured on 2-core machines). An explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

COMMAND_MODULES = (
    "hypic_rag.cli.cache_command",
    "hypic_rag.cli.precompute_command",
    "hypic_rag.cli.ask_command",
    "hypic_rag.cli.demo_command",
    "hypic_rag.cli.serve_command",
    "hypic_rag.cli.bench_command",
)


EXIT_FAILURE = 1
EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a process killed by SIGPIPE


class CliError(Exception):
    """A user-facing error: printed as one line, exits with `exit_code`."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (`hypic-rag ask: error: ... (see --help)`), exit 2, as every other
    CLI error; sub-command parsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="hypic-rag", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"hypic-rag {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name == module_name:
                continue  # command not built yet
            raise
        module.register(subparsers)
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
        return 2
    from hypic_rag.cache.errors import CacheError
    from hypic_rag.retrieval.errors import RetrievalError

    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, so that a closed pipe is noticed while it can still be handled
        return code
    except BrokenPipeError:
        # The reader went away (`| head`): print nothing more, and keep Python from complaining at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except CliError as error:
        print(f"hypic-rag {args.command}: error: {error}", file=sys.stderr)
        return error.exit_code
    except (CacheError, RetrievalError) as error:
        print(f"hypic-rag {args.command}: error: {error}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print(f"hypic-rag {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # run through the imported module so command modules and this entry point share one `CliError` class
    from hypic_rag.cli.main import main as imported_main

    sys.exit(imported_main())
