"""`hypic-rag cache stats | verify | gc | clear --cache DIR`: inspect and maintain a segment cache;
`hypic-rag cache formats`: the cache formats entries can be stored in.

Exit codes: 0 success; 1 the cache is damaged: `verify` found bad entries (corrupt, stale or mismatched), or
its data.mdb is truncated (stats, verify and gc say so in one line; `clear` replaces it with an empty cache);
2 bad input (missing directory, not a cache, read-only directory or data.mdb for gc/clear, bad size), one line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from hypic_rag.cache.errors import CacheDamagedError, CacheError
from hypic_rag.cache.lmdb_store import LmdbSegmentStore, discard_damaged_store
from hypic_rag.cache.stats import CacheStats, format_stats, namespace_summary
from hypic_rag.utils.units import human_bytes
from hypic_rag.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    EXIT_OK,
    CliError,
    add_remote_cache_arguments,
    remote_cache_config,
)

if TYPE_CHECKING:
    from hypic_rag.cache.remote_config import RemoteTierConfig

EXIT_BAD_ENTRIES = EXIT_FAILURE

_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """'1048576', '512M', '64GiB', '1.5g' -> bytes (binary units), 1 B up to 2**63 - 1."""
    match = re.fullmatch(r"\s*(\d{1,20}(?:\.\d{1,20})?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2)]) if match else 0  # <= 1e20 * 2**40: finite
    if not 1 <= size < 1 << 63:
        raise argparse.ArgumentTypeError(f"not a positive size below 8 EiB: {text!r} (e.g. 512M, 64G, 1048576)")
    return size


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("cache", help="inspect and maintain a segment cache (stats, verify, gc, clear, formats)", description=__doc__)
    actions = parser.add_subparsers(dest="cache_action", metavar="ACTION", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache", required=True, metavar="DIR", help="cache directory (holds data.mdb)")

    stats = actions.add_parser("stats", parents=[common], help="entries, bytes, hits, evictions (read-only)")
    stats.add_argument("--json", action="store_true", help="print one JSON object")
    add_remote_cache_arguments(stats)
    stats.set_defaults(func=run_stats)

    verify = actions.add_parser("verify", parents=[common], help="decode and check every entry (read-only)")
    verify.add_argument("--json", action="store_true", help="print one JSON object")
    verify.set_defaults(func=run_verify)

    gc = actions.add_parser("gc", parents=[common], help="remove bad entries, evict down to the budget")
    gc.add_argument("--budget", type=parse_size, metavar="SIZE", help="new byte budget (default: the stored one)")
    gc.set_defaults(func=run_gc)

    clear = actions.add_parser("clear", parents=[common], help="remove every entry")
    clear.set_defaults(func=run_clear)

    formats = actions.add_parser("formats", help="the cache formats (--cache-format) and their bits per value")
    formats.add_argument("--json", action="store_true", help="print one JSON object")
    formats.set_defaults(func=run_formats)


def _open(directory: str, *, readonly: bool) -> LmdbSegmentStore:
    """The store in `directory`. Here, unlike other commands, a cache that cannot be opened is bad input (exit 2:
    this command is about that directory), except a damaged one (exit 1, as `verify` finding bad entries)."""
    if not readonly:
        _refuse_read_only(Path(directory))
    try:
        return LmdbSegmentStore.open(directory, readonly=readonly, create=False)
    except CacheDamagedError as error:
        raise CliError(str(error), EXIT_BAD_ENTRIES) from None
    except CacheError as error:
        raise CliError(str(error), EXIT_BAD_INPUT) from None


def _refuse_read_only(directory: Path) -> None:
    """gc and clear change the cache: refuse a directory or data.mdb that is read-only, by its permissions for
    this user or, also for root (who may write anyway), by having no write bit at all (chmod a-w)."""
    for path in (directory, directory / "data.mdb"):
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
        except OSError:
            continue  # missing: `open` names the problem
        if not os.access(path, os.W_OK) or not mode & 0o222:
            raise CliError(f"cannot write to {path}: it is read-only (mode {mode:o}); make it writable to change "
                           "the cache (stats and verify work read-only)", EXIT_BAD_INPUT)


def run_stats(args: argparse.Namespace) -> int:
    """The local store's statistics; with --remote-cache also what the remote tier holds (a remote that fails
    is reported in the output, not as an error: the local figures stand)."""
    remote_config = remote_cache_config(args, read_only=True, write_behind=False)
    store = _open(args.cache, readonly=True)
    try:
        stats = CacheStats.from_store(store)
        namespaces = namespace_summary(store)
    finally:
        store.close()
    remote = remote_inventory(remote_config) if remote_config is not None else None
    if args.json:
        print(json.dumps({**stats.as_dict(), "namespaces": namespaces, **(remote or {})}, sort_keys=True))
    else:
        print(format_stats(stats, namespaces))
        if remote is not None:
            print(format_remote(remote))
    return EXIT_OK


def remote_inventory(config: RemoteTierConfig) -> dict[str, object]:
    """remote_url, remote_objects, remote_bytes, remote_namespaces, or remote_error when it cannot be listed."""
    from hypic_rag.cache.remote_tier import RemoteTier

    with RemoteTier(config) as tier:
        inventory = tier.inventory()
        if inventory is None:
            return {"remote_url": config.url, "remote_error": tier.health.last_error or "unknown error"}
        return {"remote_url": config.url, "remote_objects": inventory.objects, "remote_bytes": inventory.bytes,
                "remote_namespaces": len(inventory.per_namespace)}


def format_remote(remote: dict[str, object]) -> str:
    if "remote_error" in remote:
        return f"remote          {remote['remote_url']}: unavailable ({remote['remote_error']})"
    return (f"remote          {remote['remote_url']}: {remote['remote_objects']} objects, "
            f"{human_bytes(int(remote['remote_bytes']))} ({remote['remote_namespaces']} namespaces)")


def run_verify(args: argparse.Namespace) -> int:
    store = _open(args.cache, readonly=True)  # first: a bad directory is reported before torch loads
    from hypic_rag.cache.maintenance import verify_store  # imports torch; only this action needs it

    try:
        report = verify_store(store)
    finally:
        store.close()
    if args.json:
        print(json.dumps(report.as_dict(), sort_keys=True))
    else:
        for problem in report.problems:
            print(f"{problem.kind:10s} {problem.key_hex}  {problem.reason}")
        print(f"checked {report.checked} entries: {report.ok} ok, {len(report.problems)} bad"
              f" ({len(report.entries_per_namespace)} namespaces)")
    return EXIT_BAD_ENTRIES if report.problems else EXIT_OK


def run_gc(args: argparse.Namespace) -> int:
    from hypic_rag.cache.maintenance import collect_garbage

    store = _open(args.cache, readonly=False)
    try:
        _, result = collect_garbage(store, budget_bytes=args.budget)
        budget = store.budget_bytes
    finally:
        store.close()
    print(f"removed {result.removed_bad} bad entries, evicted {result.evicted}; "
          f"{result.entries_left} entries, {human_bytes(result.bytes_left)} of {human_bytes(budget)} budget")
    return EXIT_OK


def run_clear(args: argparse.Namespace) -> int:
    """Remove every entry; a damaged store (truncated data.mdb) is deleted and an empty one created instead."""
    _refuse_read_only(Path(args.cache))
    try:
        store = LmdbSegmentStore.open(args.cache, create=False)
    except CacheDamagedError:
        try:
            removed_bytes = discard_damaged_store(args.cache)
            LmdbSegmentStore.open(args.cache, create=True).close()
        except CacheError as error:
            raise CliError(str(error), EXIT_BAD_INPUT) from None
        print(f"removed the damaged store in {args.cache} ({human_bytes(removed_bytes)}); the cache is empty now, "
              "with the default budget (set another with `hypic-rag cache gc --budget SIZE`)")
        return EXIT_OK
    except CacheError as error:
        raise CliError(str(error), EXIT_BAD_INPUT) from None
    try:
        removed = store.clear()
    finally:
        store.close()
    print(f"removed {removed} entries from {args.cache}")
    return EXIT_OK


def run_formats(args: argparse.Namespace) -> int:
    """Every registered cache format: its codings per tensor kind and bits per value of P/Z and of K/V."""
    from hypic_rag.entry.compression import CACHE_FORMATS

    rows = [{"name": name, "summary": cache.summary, "codings": cache.codings(),
             "state_bits_per_value": cache.suffix_state.bits_per_value,
             "key_value_bits_per_value": cache.key_value.bits_per_value}
            for name, cache in CACHE_FORMATS.items()]
    if args.json:
        print(json.dumps({"formats": rows}, sort_keys=True))
        return EXIT_OK
    print(f"{'format':<10} {'P/Z bits':>8} {'K/V bits':>8}  codings (transition, suffix_state, conv_tail, key_value)")
    for row in rows:
        codings = ", ".join(row["codings"].values())
        print(f"{row['name']:<10} {row['state_bits_per_value']:>8.3g} {row['key_value_bits_per_value']:>8.3g}  "
              f"{codings}: {row['summary']}")
    return EXIT_OK
