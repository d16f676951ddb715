"""`hypic-rag bench`: all six modes side by side; JSON, markdown and PNG under docs/benchmarks/."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmark the six modes side by side (TTFT, throughput, quality)")
    parser.add_argument("--quick", action="store_true", help="the small profile: a few minutes on 2 CPU cores")
    parser.add_argument("--profile", choices=("quick", "standard", "full", "test"), default=None, help="explicit profile (overrides --quick)")
    parser.add_argument("--output", default="docs/benchmarks", help="directory for JSON, markdown and PNG")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--skip-quality", action="store_true", help="skip exact-match quality on the default model")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hypic_rag.bench.report import markdown, write_report
    from hypic_rag.bench.run import PROFILES, run_benchmark
    from hypic_rag.cli.main import CliError
    from hypic_rag.paths import unusable_directory_reason

    output = Path(args.output)
    reason = unusable_directory_reason(output)  # before the benchmark runs, not after
    if reason is not None:
        raise CliError(f"--output unusable: {reason}")
    profile = args.profile or ("quick" if args.quick else "full")
    config = PROFILES[profile]
    quality = None
    if not args.skip_quality and config.quality_questions > 0:
        from hypic_rag.bench.quality import default_model_quality

        quality = default_model_quality
    command = "hypic-rag bench" + (f" --profile {profile}" if args.profile else " --quick" if args.quick else "")
    result = run_benchmark(config, command=command, show_progress=not args.no_progress and sys.stderr.isatty(), quality=quality)
    written = write_report(result, output)
    print(markdown(result))
    print("written: " + ", ".join(str(path) for path in written))
    return 0
