"""What the commands share: exit codes, `CliError`, argument types and the options several commands take.

Imports nothing heavy (torch only inside `device_name`, when `--device` is given), so `hypic-rag --help` stays fast.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from hypic_rag.errors import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_MISMATCH, EXIT_OK, HypicError, MissingPathError

__all__ = [
    "DTYPE_CHOICES",
    "EXIT_BAD_INPUT",
    "EXIT_BROKEN_PIPE",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_MISMATCH",
    "EXIT_OK",
    "CliError",
    "add_dtype_argument",
    "device_name",
    "non_negative_int",
    "positive_int",
    "recompute_policy_spec",
    "resolve_model_path",
    "worker_count",
]

EXIT_BROKEN_PIPE = 128 + 13
"""Output cut short by its reader (`| head`): what a shell reports for a process killed by SIGPIPE."""
EXIT_INTERRUPTED = 128 + 2
"""Ctrl-C: what a shell reports for a process killed by SIGINT."""

DTYPE_CHOICES = ("float32", "bfloat16", "float16")
"""`--dtype` values: the names of `hypic_rag.runtime.model.DTYPES` (not imported here: it loads torch)."""


class CliError(HypicError):
    """A user-facing error a command raises itself: printed as one line, exits with `exit_code` (default 2, bad
    input). Errors of the library (`HypicError`s) need no wrapping: `hypic_rag.cli.main` prints them the same way
    with their own exit code; a command wraps one only to say more or to exit with another code."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, exit_code: int = EXIT_BAD_INPUT) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def integer_at_least(text: str, minimum: int, *, what: str = "an integer") -> int:
    """`text` as an integer >= `minimum`, or an argparse error naming what is wrong."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    return integer_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return integer_at_least(text, 0)


def recompute_policy_spec(text: str) -> str:
    """A recompute policy spec (`hypic_rag.runtime.recompute_policy`), checked; an argparse error naming the forms."""
    from hypic_rag.runtime.recompute_policy import RecomputePolicy, RecomputePolicyError

    try:
        return RecomputePolicy.parse(text).spec
    except RecomputePolicyError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_recompute_policy_argument(parser: argparse.ArgumentParser) -> None:
    """The `--recompute-policy` option of ask and serve."""
    parser.add_argument(
        "--recompute-policy", type=recompute_policy_spec, metavar="SPEC",
        help="what hypic recomputes: seam, seam@W, whole:N[@W] (the N top-ranked chunks whole, seam W for the rest), "
             "budget:X[@W] (whole chunks while at most X times the seam's tokens), tokens:N[@W] (while at most N "
             "chunk tokens); default: the index's calibrated policy (hypic-rag calibrate), else seam",
    )


def add_dtype_argument(parser: argparse.ArgumentParser, default_help: str) -> None:
    """The `--dtype` option shared by precompute, ask and serve."""
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, help=f"dtype the model runs in ({default_help})")


def device_name(text: str) -> str:
    """A torch device this machine has ('cpu', 'cuda', 'cuda:1', ...), checked before any model loads."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a device: {text!r} (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available here (use --device cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA devices")
    elif device.type not in ("cpu", "mps"):
        raise argparse.ArgumentTypeError(f"unsupported device {text!r} (use cpu or cuda)")
    return text


def worker_count(text: str) -> int:
    """1 up to the CPU cores of this machine (each worker is a process holding its own copy of the model)."""
    value = positive_int(text)
    cores = os.cpu_count() or 1
    if value > cores:
        raise argparse.ArgumentTypeError(f"at most {cores} (the CPU cores here), got {value}")
    return value


def resolve_model_path(given: str | None) -> Path:
    """--model, else the bundled default model; a one-line error naming --model (exit 2) when neither is there."""
    from hypic_rag.default_model import resolve_model_path as resolve

    try:
        return resolve(given)
    except MissingPathError as error:
        raise CliError(f"{error} (--model PATH)", EXIT_BAD_INPUT) from None
