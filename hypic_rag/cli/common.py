"""What the commands share: exit codes, `CliError`, argument types and the options several commands take.

Every numeric option has a stated range (`int_in`, `number_in`, `seconds_in`; the shared ones in
`hypic_rag.utils.limits`) and is refused outside it, as a usage error naming the option and the range (exit 2).

Imports nothing heavy (torch only inside `device_name`, when `--device` is given), so `hypic-rag --help` stays fast.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hypic_rag.errors import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_MISMATCH, EXIT_OK, HypicError, MissingPathError
from hypic_rag.utils.limits import NumberRange

if TYPE_CHECKING:
    from hypic_rag.cache.remote_config import RemoteTierConfig

__all__ = [
    "DTYPE_CHOICES",
    "EXIT_BAD_INPUT",
    "EXIT_BROKEN_PIPE",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_MISMATCH",
    "EXIT_OK",
    "CliError",
    "add_cache_format_argument",
    "add_dtype_argument",
    "add_remote_cache_arguments",
    "device_name",
    "int_in",
    "number_in",
    "process_seconds",
    "recompute_policy_spec",
    "remote_cache_config",
    "resolve_model_path",
    "seconds_in",
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


NumberType = Callable[[str], "int | float"]
"""An argparse `type` for a number: parses the text and checks it against its range (`.allowed`)."""


def process_seconds() -> float | None:
    """Seconds since this process started (the interpreter's own start-up included), from Linux's /proc at its
    10 ms resolution; None where that is not available."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        with open("/proc/uptime", encoding="ascii") as uptime:
            now = float(uptime.read().split()[0])
        return max(0.0, now - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22, starttime, in clock ticks
    except (OSError, ValueError, IndexError):
        return None


def number_in(allowed: NumberRange) -> NumberType:
    """The argparse `type` of a number in `allowed`: "argument --top-k: must be an integer in 1..256, got 0" for a
    value out of range, negative, huge, non-numeric, non-finite or not UTF-8 (every one a usage error, exit 2). The
    range is kept as `.allowed` (tests walk every numeric option with it)."""

    def parse(text: str) -> int | float:
        try:
            return allowed.parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.allowed = allowed  # type: ignore[attr-defined]
    parse.__name__ = "integer" if allowed.integer else "number"  # argparse names the type in some messages
    return parse


def int_in(minimum: int, maximum: int) -> NumberType:
    """The argparse `type` of an integer in `minimum`..`maximum` (`number_in`)."""
    return number_in(NumberRange(minimum, maximum))


def seconds_in(maximum: float) -> NumberType:
    """The argparse `type` of a positive, finite number of seconds up to `maximum` (`number_in`)."""
    return number_in(NumberRange(0, maximum, integer=False, minimum_exclusive=True))


def recompute_policy_spec(text: str) -> str:
    """A recompute policy spec (`hypic_rag.runtime.recompute_policy`), checked; an argparse error naming the forms."""
    from hypic_rag.runtime.recompute_policy import RecomputePolicy, RecomputePolicyError

    try:
        return RecomputePolicy.parse(text).spec
    except RecomputePolicyError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def neighbours_spec(text: str) -> str:
    """A neighbour expansion `KIND[:SLOTS]` (`hypic_rag.retrieval.chunk_context`), checked; an argparse error
    naming the forms."""
    from hypic_rag.retrieval.chunk_context import LEGACY_RETRIEVAL

    try:
        return LEGACY_RETRIEVAL.with_neighbours(text).neighbours_spec
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_neighbours_argument(parser: argparse.ArgumentParser) -> None:
    """The `--neighbours` option of ask, serve and calibrate: the neighbour expansion of each search. (`demo` has
    none: every document of the bundled example corpus is one chunk at the demo's chunk size, so no KIND:SLOTS
    brings anything.)"""
    from hypic_rag.retrieval.chunk_context import DEFAULT_RETRIEVAL

    parser.add_argument(
        "--neighbours", type=neighbours_spec, metavar="KIND[:SLOTS]",
        help="neighbour expansion: each retrieved chunk brings its document's next / previous / both chunks into "
             "the top-k places, at most SLOTS of them (next:1, both:2, none); default: what the index records "
             f"(new indexes: {DEFAULT_RETRIEVAL.neighbours_spec}; docs/retrieval.md)",
    )


def add_recompute_policy_argument(parser: argparse.ArgumentParser) -> None:
    """The `--recompute-policy` option of ask and serve (the forms of every registered policy)."""
    from hypic_rag.runtime.recompute_policy import policy_help

    parser.add_argument(
        "--recompute-policy", type=recompute_policy_spec, metavar="SPEC",
        help=f"what hypic recomputes: {policy_help()}; default: the index's calibrated policy (hypic-rag calibrate), "
             "else seam",
    )


def add_index_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ask and serve that say how to run the model an index was built for: `--model`, `--device`,
    `--dtype`, `--cache-format` (each the index's by default) and the remote cache tier."""
    parser.add_argument("--model", metavar="PATH", help="model checkpoint (default: the one the index was built for)")
    parser.add_argument("--device", type=device_name, help="model device, e.g. cpu or cuda (default: cuda when available)")
    add_dtype_argument(parser, "default: the one the index was built with")
    add_cache_format_argument(parser, "default: the index's; naming another fails in one line")
    add_remote_cache_arguments(parser)


def add_dtype_argument(parser: argparse.ArgumentParser, default_help: str) -> None:
    """The `--dtype` option shared by precompute, ask and serve."""
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, help=f"dtype the model runs in ({default_help})")


def cache_format_name(text: str) -> str:
    """A cache format name (`hypic_rag.entry.compression.CACHE_FORMATS`), checked; an argparse error listing them."""
    from hypic_rag.entry.compression import cache_format

    try:
        return cache_format(text).name
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_cache_format_argument(parser: argparse.ArgumentParser, default_help: str) -> None:
    """The `--cache-format` option of precompute, ask and serve (docs/cache.md, "Cache formats")."""
    parser.add_argument(
        "--cache-format", type=cache_format_name, metavar="NAME",
        help=f"format the cache stores entries in, e.g. float32, bfloat16, int8, int7, int4 (`hypic-rag cache "
             f"formats` lists them with their bits per value; {default_help})",
    )


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


def worker_count() -> NumberType:
    """The argparse `type` of a worker count: 1 up to the CPU cores of this machine (each worker is a process
    holding its own copy of the model)."""
    return int_in(1, os.cpu_count() or 1)


def resolve_model_path(given: str | None) -> Path:
    """--model, else the bundled default model; a one-line error naming --model (exit 2) when neither is there."""
    from hypic_rag.demo.default_model import resolve_model_path as resolve

    try:
        return resolve(given)
    except MissingPathError as error:
        raise CliError(f"{error} (--model PATH)", EXIT_BAD_INPUT) from None


def _remote_cache_url(text: str) -> str:
    """An ``s3://BUCKET[/PREFIX]`` URL, checked (the client library is not loaded yet)."""
    from hypic_rag.cache.remote_config import RemoteTierConfig
    from hypic_rag.cache.errors import RemoteTierConfigError

    try:
        RemoteTierConfig.from_url(text)
    except RemoteTierConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def add_remote_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """`--remote-cache` and `--remote-endpoint`, shared by precompute, ask and serve (docs/cache.md, "Remote tier")."""
    parser.add_argument("--remote-cache", type=_remote_cache_url, metavar="s3://BUCKET[/PREFIX]",
                        help="shared remote cache tier below the local one (S3-compatible; credentials from the "
                             "standard AWS environment variables or profile); a failing remote only costs misses")
    parser.add_argument("--remote-endpoint", metavar="URL",
                        help="endpoint of an S3-compatible server for --remote-cache, e.g. http://127.0.0.1:9000 "
                             "(default: AWS, or AWS_ENDPOINT_URL)")


def remote_cache_config(args: argparse.Namespace, **options: Any) -> RemoteTierConfig | None:
    """The remote tier that `--remote-cache` / `--remote-endpoint` name (None without `--remote-cache`), with
    other `RemoteTierConfig` fields from `options`; a bad endpoint, or boto3 missing, is bad input (exit 2)."""
    from hypic_rag.cache.errors import RemoteTierConfigError
    from hypic_rag.cache.remote_config import RemoteTierConfig
    from hypic_rag.cache.remote_tier import check_client_installed

    if args.remote_cache is None:
        if args.remote_endpoint is not None:
            raise CliError("--remote-endpoint needs --remote-cache s3://BUCKET[/PREFIX]", EXIT_BAD_INPUT)
        return None
    try:
        config = RemoteTierConfig.from_url(args.remote_cache, endpoint_url=args.remote_endpoint, **options)
    except RemoteTierConfigError as error:
        raise CliError(str(error), EXIT_BAD_INPUT) from None
    check_client_installed()
    return config
