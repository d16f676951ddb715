"""`hypic-rag calibrate --index DIR [--kl-target X]`: choose the index's recompute policy and cache format, and
record them.

Builds calibration requests as `ask` does (questions from `--questions FILE`, else probes made from the index's
own chunks), scores each candidate recompute policy against `full` by the mean KL divergence of the next-token
distribution, and records the one recomputing fewest tokens whose mean KL is at most `--kl-target` in the index
manifest (`--max-recompute X`: only among the candidates recomputing at most X times the fixed seam's tokens per
request); `ask` and `serve` then use it unless given `--recompute-policy`; `hypic-rag precompute` run again encodes
the entries it reads. Prints a table of the candidates (or
`--json`). Then, on the same requests under the chosen policy, it scores each cache format (`--cache-format`, a
comma-separated list; default: every format) by the mean KL of the next-token distribution between float32 entries
and entries in that format, and records the smallest format whose mean KL is at most `--format-kl-target` as the
index's recommended format (the index keeps its own until `hypic-rag precompute --cache-format NAME` rebuilds its
cache; `--no-cache-format` skips this step). `--dry-run` records nothing. Exit codes: 0 done (also when no
candidate met the target: the closest is recorded and the output says so); 2 bad input; 3 index built for another
model; 1 another process writes the index (stop it first).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypic_rag.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    EXIT_OK,
    CliError,
    add_dtype_argument,
    cache_format_name,
    device_name,
    int_in,
    add_neighbours_argument,
    number_in,
    recompute_policy_spec,
)
from hypic_rag.utils.limits import HOP_SLOTS, POLICY_BUDGET, TOP_K, NumberRange
from hypic_rag.runtime.recompute_policy import DEFAULT_KL_TARGET, calibration_candidates

KL_TARGET = NumberRange(0, 1_000, integer=False)
"""--kl-target: a mean KL divergence in nats (0.1 by default; a target above a few nats accepts any policy)."""


def _candidates(text: str) -> list[str]:
    specs = [recompute_policy_spec(part) for part in text.split(",") if part.strip()]
    if not specs:
        raise argparse.ArgumentTypeError("no candidate policies given")
    return specs


def _formats(text: str) -> list[str]:
    names = [cache_format_name(part.strip()) for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError("no cache formats given")
    return names


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "calibrate", help="choose what hypic recomputes and the cache format for an index (KL target), and record them", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--index", required=True, metavar="DIR", help="index directory made by precompute")
    parser.add_argument("--kl-target", type=number_in(KL_TARGET), default=DEFAULT_KL_TARGET, metavar="X",
                        help="largest mean KL(full || policy) of the next-token distribution accepted "
                             f"({DEFAULT_KL_TARGET:g})")
    parser.add_argument("--questions", metavar="FILE",
                        help="questions, one per line or JSON lines with \"question\" (default: probes from the index)")
    parser.add_argument("--requests", type=int_in(1, 10_000), default=32, metavar="N",
                        help="calibration requests (32; the first N questions of --questions)")
    parser.add_argument("--top-k", type=number_in(TOP_K), default=4, metavar="K",
                        help="chunks retrieved per request, as ask will retrieve them (4)")
    parser.add_argument("--hop-slots", type=number_in(HOP_SLOTS), default=2, metavar="N",
                        help="of the top-k places, how many go to one retrieval hop (2, as ask)")
    parser.add_argument("--max-recompute", type=number_in(POLICY_BUDGET), default=None, metavar="X",
                        help="choose only among candidates recomputing at most X times the tokens per request of the "
                             "fixed seam on the same requests (a bound on time to first token; default: no bound)")
    add_neighbours_argument(parser)
    parser.add_argument("--candidates", type=_candidates, metavar="SPECS",
                        help="comma-separated policies to compare (default: "
                             f"{', '.join(policy.spec for policy in calibration_candidates())})")
    parser.add_argument("--model", metavar="PATH", help="model checkpoint (default: the one the index was built for)")
    parser.add_argument("--device", type=device_name, help="model device (default: cuda when available)")
    add_dtype_argument(parser, "default: the one the index was built with")
    parser.add_argument("--cache-format", type=_formats, metavar="NAMES",
                        help="cache formats to compare, comma-separated (default: every format but float32, "
                             "`hypic-rag cache formats`)")
    parser.add_argument("--format-kl-target", type=number_in(KL_TARGET), default=None, metavar="X",
                        help="largest mean KL(float32 entries || format entries) accepted (0.001)")
    parser.add_argument("--no-cache-format", action="store_true", help="choose the recompute policy only")
    parser.add_argument("--dry-run", action="store_true", help="print the choice, record nothing")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the record)")
    parser.set_defaults(func=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    from hypic_rag.calibration.index import calibrate_index, read_questions
    from hypic_rag.pipeline.answering import RagPipeline
    from hypic_rag.retrieval.corpus_index import check_not_locked, record_cache_format_choice, record_recompute_policy
    from hypic_rag.retrieval.errors import IndexLockedError
    from hypic_rag.retrieval.manifest import MANIFEST_FILE

    index_dir = Path(args.index).expanduser()
    if not (index_dir / MANIFEST_FILE).is_file():
        raise CliError(f"no index at {str(index_dir)!r}; build one with `hypic-rag precompute CORPUS --index {args.index}`",
                       EXIT_BAD_INPUT)
    questions = read_questions(args.questions, limit=args.requests) if args.questions else None
    if not args.dry_run:
        try:
            check_not_locked(index_dir.resolve())
        except IndexLockedError as error:
            raise CliError(f"{error}; stop it (calibration records its choice in the manifest) or pass --dry-run",
                           EXIT_FAILURE) from None
    pipeline = RagPipeline.open(index_dir, model_path=args.model, device=args.device, dtype=args.dtype,
                                hop_slots=args.hop_slots, recompute_policy="seam", neighbours=args.neighbours)

    def progress(done: int, total: int) -> None:
        print(f"\rcalibrating: {done}/{total} requests", end="" if done < total else "\n", file=sys.stderr, flush=True)

    try:
        result, record = calibrate_index(
            pipeline, kl_target=args.kl_target, questions=questions, requests=args.requests, top_k=args.top_k,
            candidates=args.candidates or None, max_recompute=args.max_recompute,
            on_progress=None if args.json else progress,
        )
        formats = None if args.no_cache_format else calibrate_format_step(
            args, pipeline, questions, result.chosen, None if args.json else progress)
    finally:
        pipeline.close()
    if not args.dry_run:
        try:
            record_recompute_policy(index_dir, record)
            if formats is not None:
                record_cache_format_choice(index_dir, formats[1])
        except IndexLockedError as error:
            raise CliError(f"{error}; stop it or pass --dry-run", EXIT_FAILURE) from None
    if args.json:
        extra = {} if formats is None else {"cache_format_choice": formats[1]}
        print(json.dumps({**record, **extra, "recorded": not args.dry_run}, ensure_ascii=False))
        return EXIT_OK
    cap = "" if result.token_cap is None else \
        f", at most {result.token_cap:.1f} recomputed tokens per request ({args.max_recompute:g}x the fixed seam's)"
    print(f"Calibrated on {record['requests']} requests ({record['source']}, top-k {args.top_k}), KL target "
          f"{args.kl_target:g}{cap}:")
    print(f"  {'policy':<16} {'recomputed/request':>18} {'mean KL':>10} {'max KL':>10} {'top-1 agree':>12}")
    for candidate in result.candidates:
        mark = "  <- chosen" if candidate.spec == result.chosen.spec else (
            "  (above the cap)" if result.token_cap is not None and candidate.recomputed_tokens > result.token_cap
            else "")
        print(f"  {candidate.spec:<16} {candidate.recomputed_tokens:>18.1f} {candidate.mean_kl:>10.4f} "
              f"{candidate.max_kl:>10.4f} {100 * candidate.top1_agreement:>11.1f}%{mark}")
    verdict = "meets the target" if result.met else "is the closest (no candidate met the target)"
    where = "not recorded (--dry-run)" if args.dry_run else "recorded in the index manifest; ask and serve use it"
    print(f"Policy {result.chosen.spec} {verdict}; {where}.")
    if formats is not None:
        print_format_choice(formats[0], formats[1], args)
    return EXIT_OK


def calibrate_format_step(
    args: argparse.Namespace, pipeline: Any, questions: list[str] | None, policy: Any,
    progress: Callable[[int, int], None] | None,
) -> tuple[Any, dict[str, Any]]:
    """The cache format step on the same requests, under the chosen `policy`: (the `FormatChoice`, its record)."""
    from hypic_rag.calibration.index import calibrate_index_format
    from hypic_rag.calibration.cache_format import DEFAULT_FORMAT_KL_TARGET

    target = DEFAULT_FORMAT_KL_TARGET if args.format_kl_target is None else args.format_kl_target
    return calibrate_index_format(
        pipeline, kl_target=target, questions=questions, requests=args.requests, top_k=args.top_k,
        formats=args.cache_format or None, policy=policy, on_progress=progress,
    )


def print_format_choice(choice: Any, record: dict[str, Any], args: argparse.Namespace) -> None:
    """The format table (smallest first), the choice and what to run to rebuild the cache in it."""
    print(f"Cache formats under policy {record['policy']}, KL(float32 entries || format) target {choice.kl_target:g}:")
    print(f"  {'format':<10} {'bytes vs float32':>16} {'mean KL':>10} {'p99 KL':>10} {'top-1 agree':>12}")
    for score in choice.candidates:
        mark = "  <- chosen" if score.cache_format == choice.chosen else ""
        print(f"  {score.cache_format:<10} {100 * score.bytes_ratio:>15.1f}% {score.mean_kl:>10.2e} "
              f"{score.p99_kl:>10.2e} {100 * score.top1_agreement:>11.1f}%{mark}")
    verdict = ("is the smallest meeting the target" if choice.met
               else "(float32) is kept: no compressed format met the target")
    where = "not recorded (--dry-run)" if args.dry_run else "recorded in the index manifest as its recommended format"
    print(f"Format {choice.chosen} {verdict}; {where}.")
    current = record["index_cache_format"]
    if choice.chosen != current:
        print(f"The index's cache is in {current}; rebuild it in {choice.chosen} with "
              f"`hypic-rag precompute CORPUS --index {args.index} --cache-format {choice.chosen}`.")
