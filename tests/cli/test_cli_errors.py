"""One root error type, mapped to exit codes once: every error class of the package derives from `HypicError`, and
`hypic_rag.cli.main` turns each one a command raises into one stderr line and the error's exit code; the three
entry points (`hypic-rag`, `python -m hypic_rag`, `python -m hypic_rag.cli.main`) share that mapping."""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

import hypic_rag
from hypic_rag.cli import main as cli_main
from hypic_rag.cli.common import CliError
from hypic_rag.errors import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_MISMATCH, HypicError

ROOT = Path(__file__).resolve().parents[2]


def package_exception_classes() -> set[type[BaseException]]:
    """Every exception class defined in a module of `hypic_rag` (each module imported; `__main__` runs the CLI)."""
    found: set[type[BaseException]] = set()
    for info in pkgutil.walk_packages(hypic_rag.__path__, "hypic_rag."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        found.update(
            value for value in vars(module).values()
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == info.name
        )
    return found


def documented_exit_codes() -> dict[type[HypicError], int]:
    """The exit code of each error class a command lets reach `cli/main`, as docs/*.md document them."""
    from hypic_rag.cache import errors as cache
    from hypic_rag.errors import MissingPathError
    from hypic_rag.pipeline.answering import PipelineError
    from hypic_rag.retrieval import errors as retrieval
    from hypic_rag.retrieval.encoding_pool import EncodingPoolError, WorkerStartError
    from hypic_rag.retrieval.parsers import UnreadableFile
    from hypic_rag.runtime.model import ModelLoadError, UnsupportedModelError
    from hypic_rag.runtime.modes import UnknownModeError
    from hypic_rag.runtime.recompute_policy import RecomputePolicyError
    from hypic_rag.calibration.index import CalibrationError
    from hypic_rag.distributed.cluster import RayUnavailableError
    from hypic_rag.distributed.front import ReplicaUnreachable
    from hypic_rag.distributed.rendezvous import NoReplicaAvailable
    from hypic_rag.distributed.front import ReplicaStartError
    from hypic_rag.errors import PromptTooLongError
    from hypic_rag.runtime.scheduler import SchedulerFullError, SchedulerStopped, SequenceCancelled
    from hypic_rag.server.runner import AddressInUseError
    from hypic_rag.bench.peers import PeerMissingError

    return {
        HypicError: EXIT_FAILURE,
        CliError: EXIT_BAD_INPUT,
        MissingPathError: EXIT_BAD_INPUT,
        cache.CacheError: EXIT_FAILURE,
        cache.CacheOpenError: EXIT_FAILURE,  # `hypic-rag cache` itself calls it bad input (2), see test_cache_cli
        cache.CacheDamagedError: EXIT_FAILURE,
        cache.CacheWriteError: EXIT_FAILURE,
        cache.CorruptEntryError: EXIT_FAILURE,
        cache.IncompatibleEntryError: EXIT_FAILURE,
        cache.RemoteTierConfigError: EXIT_BAD_INPUT,  # docs/cache.md "Remote tier": a bad --remote-cache is exit 2
        retrieval.RetrievalError: EXIT_FAILURE,
        retrieval.CorpusNotFoundError: EXIT_BAD_INPUT,
        retrieval.EmptyCorpusError: EXIT_BAD_INPUT,
        retrieval.IndexMismatchError: EXIT_MISMATCH,
        retrieval.IndexNotFoundError: EXIT_BAD_INPUT,
        retrieval.IndexCorruptError: EXIT_FAILURE,
        retrieval.IndexLockedError: EXIT_FAILURE,
        retrieval.IndexWriteError: EXIT_FAILURE,
        retrieval.IndexLocationError: EXIT_BAD_INPUT,
        EncodingPoolError: EXIT_FAILURE,
        WorkerStartError: EXIT_FAILURE,
        UnreadableFile: EXIT_BAD_INPUT,
        PipelineError: EXIT_BAD_INPUT,
        ModelLoadError: EXIT_BAD_INPUT,
        UnsupportedModelError: EXIT_BAD_INPUT,
        UnknownModeError: EXIT_BAD_INPUT,
        AddressInUseError: EXIT_FAILURE,
        RecomputePolicyError: EXIT_BAD_INPUT,  # a bad --recompute-policy spec (docs/retrieval.md)
        CalibrationError: EXIT_BAD_INPUT,  # `hypic-rag calibrate` on an index it cannot calibrate
        RayUnavailableError: EXIT_BAD_INPUT,
        ReplicaStartError: EXIT_FAILURE,
        ReplicaUnreachable: EXIT_FAILURE,  # the front's: it sends the request to another replica, or answers 503
        NoReplicaAvailable: EXIT_FAILURE,
        PromptTooLongError: EXIT_BAD_INPUT,  # HypicLLM's (docs/llama_index.md, "LLM")
        SchedulerFullError: EXIT_FAILURE,  # the scheduler's errors (docs/runtime.md, "Continuous batching")
        SequenceCancelled: EXIT_FAILURE,
        SchedulerStopped: EXIT_FAILURE,
        PeerMissingError: EXIT_FAILURE,  # the peers benchmark without llama.cpp (docs/benchmarks/peers.md)
    }


def test_every_error_class_of_the_package_derives_from_the_root_and_has_a_documented_code() -> None:
    from hypic_rag.server.errors import ServiceError

    classes = package_exception_classes()
    assert HypicError in classes and CliError in classes
    strays = sorted(cls.__qualname__ for cls in classes if not issubclass(cls, HypicError))
    assert strays == [], f"error classes outside the HypicError root: {strays}"
    codes = documented_exit_codes()
    service_errors = {cls for cls in classes if issubclass(cls, ServiceError)}  # HTTP statuses, never a CLI exit
    assert classes - service_errors == set(codes), "a new error class needs its exit code in this table and docs"
    assert {cls: cls.exit_code for cls in codes} == codes


def raise_command(error: BaseException) -> types.ModuleType:
    """A command module whose `raise` command raises `error`, as a real command module registers itself."""
    module = types.ModuleType("raise_command")

    def run(args: argparse.Namespace) -> int:
        raise error

    def register(subparsers: argparse._SubParsersAction) -> None:
        subparsers.add_parser("raise").set_defaults(func=run)

    module.register = register  # type: ignore[attr-defined]
    return module


def make_error(cls: type[HypicError], message: str) -> HypicError:
    if issubclass(cls, OSError):
        return cls(98, message)  # AddressInUseError(errno, message), as bind_socket raises it
    return cls(message)


@pytest.mark.parametrize("cls", list(documented_exit_codes()), ids=lambda cls: cls.__name__)
def test_cli_main_maps_each_error_to_one_line_and_its_exit_code(
    cls: type[HypicError], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    error = make_error(cls, f"{cls.__name__} happened; fix it")
    monkeypatch.setitem(sys.modules, "raise_command", raise_command(error))
    monkeypatch.setattr(cli_main, "COMMAND_MODULES", (*cli_main.COMMAND_MODULES, "raise_command"))
    code = cli_main.main(["raise"])
    captured = capsys.readouterr()
    assert code == documented_exit_codes()[cls] == error.exit_code
    assert captured.err == f"hypic-rag raise: error: {error}\n" and f"{cls.__name__} happened; fix it" in captured.err
    assert captured.out == ""


def test_a_command_may_choose_another_exit_code(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "raise_command", raise_command(CliError("index mismatch, said so", 3)))
    monkeypatch.setattr(cli_main, "COMMAND_MODULES", (*cli_main.COMMAND_MODULES, "raise_command"))
    assert cli_main.main(["raise"]) == 3
    assert capsys.readouterr().err == "hypic-rag raise: error: index mismatch, said so\n"


def test_a_bug_is_not_turned_into_a_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only HypicErrors are user errors: anything else keeps its traceback (a bug to report, not to hide)."""
    monkeypatch.setitem(sys.modules, "raise_command", raise_command(KeyError("bug")))
    monkeypatch.setattr(cli_main, "COMMAND_MODULES", (*cli_main.COMMAND_MODULES, "raise_command"))
    with pytest.raises(KeyError):
        cli_main.main(["raise"])


@pytest.mark.parametrize("entry", ["hypic_rag", "hypic_rag.cli.main"])
def test_both_module_entry_points_share_one_error_mapping(entry: str, tmp_path: Path) -> None:
    """A CliError raised by a command (bench) and a library error (ask's IndexNotFoundError) are one line and
    exit 2 under `python -m hypic_rag` and `python -m hypic_rag.cli.main` alike (the latter runs main.py as
    `__main__`: no second copy of the error classes)."""
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    environment = dict(os.environ, PYTHONPATH=str(ROOT), OMP_WAIT_POLICY="PASSIVE")
    for arguments, line in (
        (["bench", "--output", str(a_file / "out")], "hypic-rag bench: error: --output unusable: "),
        (["ask", "--index", str(a_file), "question"], f"hypic-rag ask: error: '{a_file}' is a file, not an index"),
    ):
        done = subprocess.run([sys.executable, "-m", entry, *arguments], capture_output=True, text=True, check=False,
                              timeout=120, env=environment)
        assert done.returncode == EXIT_BAD_INPUT, done.stderr
        assert done.stderr.count("\n") == 1 and done.stderr.startswith(line), done.stderr
        assert done.stdout == ""
