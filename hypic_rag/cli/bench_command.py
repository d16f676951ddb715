"""`hypic-rag bench`: all six modes side by side on a random timing model; JSON, markdown and PNG.

With no flags it runs the quick profile (a few minutes on 2 CPU cores) and writes into `./hypic-rag-bench/`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hypic_rag.cli.common import EXIT_OK, CliError

DEFAULT_OUTPUT = "hypic-rag-bench"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmark the six modes side by side (TTFT, throughput, deviation)",
                                   description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the small profile (the default): a few minutes on 2 CPU cores")
    parser.add_argument("--profile", choices=("quick", "standard", "full", "test"), default=None,
                        help="explicit profile (overrides --quick; default quick)")
    parser.add_argument("--output", default=DEFAULT_OUTPUT,
                        help=f"directory for JSON, markdown and PNG (default ./{DEFAULT_OUTPUT}, created)")
    parser.add_argument("--sections", default="modes,throughput", type=_sections, metavar="LIST",
                        help="what to measure, comma-separated: modes (the six modes side by side, the seam sweep), "
                             "throughput (continuous batching against one request at a time, closed loop, on the "
                             "timing model and through the server with the bundled model), cache_formats (every "
                             "cache format: bytes per chunk of every family, KL on tiny models, load time, hypic TTFT "
                             "warm and cold; writes cache_formats.json/.md); default modes,throughput")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--ray-scaling", action="store_true",
                        help="instead: encoding throughput of 1 vs 2 Ray actors against this process (a private Ray "
                             "instance; needs the ray extra); writes ray_scaling.json")
    parser.add_argument("--families", action="store_true",
                        help="instead: per model family, cache bytes per chunk at a published checkpoint's shapes and "
                             "time to first token against transformers' forward on a ~100-200M random model (about "
                             "10-15 minutes on 2 CPU cores; --profile test: tiny models); writes families.json/.md")
    parser.add_argument("--family", action="append", metavar="MODEL_TYPE",
                        help="with --families: only this family (repeatable), e.g. --family jamba")
    parser.set_defaults(func=run)


CACHE_FORMATS_SECTION = "cache_formats"
"""A section of its own report (`hypic_rag.bench.cache_formats`), run before the others."""


def _sections(text: str) -> tuple[str, ...]:
    from hypic_rag.bench.run import SECTIONS

    known = (*SECTIONS, CACHE_FORMATS_SECTION)
    sections = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [section for section in sections if section not in known]
    if unknown or not sections:
        raise argparse.ArgumentTypeError(f"choose among {', '.join(known)} (comma-separated), got {text!r}")
    return sections


def run(args: argparse.Namespace) -> int:
    from hypic_rag.bench.report import markdown, write_report
    from hypic_rag.bench.run import PROFILES, run_benchmark
    from hypic_rag.utils.paths import unusable_directory_reason

    output = Path(args.output)
    reason = unusable_directory_reason(output)  # before the benchmark runs, not after
    if reason is not None:
        raise CliError(f"--output unusable: {reason}")
    if args.ray_scaling:  # a private Ray instance: it ends with this command, however it ends
        from hypic_rag.utils.reaper import reap_on_exit

        reap_on_exit()
        return run_ray_scaling(args, output)
    if args.families or args.family:
        return run_families_bench(args, output)
    if CACHE_FORMATS_SECTION in args.sections:
        run_cache_formats_bench(args, output)
        args.sections = tuple(section for section in args.sections if section != CACHE_FORMATS_SECTION)
        if not args.sections:
            return EXIT_OK
    profile = args.profile or "quick"
    config = PROFILES[profile]
    command = f"hypic-rag bench --profile {profile}"
    if set(args.sections) != {"modes", "throughput"}:
        command += f" --sections {','.join(args.sections)}"
    print(f"benchmark profile {profile}; results go to {output.resolve()}", file=sys.stderr)
    result = run_benchmark(config, command=command, show_progress=not args.no_progress and sys.stderr.isatty(),
                           sections=args.sections)
    written = write_report(result, output)
    print(markdown(result))
    print("written: " + ", ".join(str(path) for path in written))
    return EXIT_OK


def run_ray_scaling(args: argparse.Namespace, output: Path) -> int:
    """`--ray-scaling`: the Ray encoding benchmark (`hypic_rag.bench.ray_scaling`), `--profile test` for a tiny run."""
    from hypic_rag.bench.ray_scaling import QUICK, TEST, markdown_row, run_scaling, write_scaling

    config = TEST if args.profile == "test" else QUICK
    print(f"ray scaling benchmark ({config.segments} segments); results go to {output.resolve()}", file=sys.stderr)
    result = run_scaling(config)
    written = write_scaling(result, output)
    print(markdown_row(result))
    print(f"written: {written}")
    return EXIT_OK


def run_families_bench(args: argparse.Namespace, output: Path) -> int:
    """`--families`: the model-family benchmark (`hypic_rag.bench.families`); `--profile test` for tiny models."""
    from hypic_rag.bench.families import FAMILIES_PROFILES, families_markdown, run_families, write_families

    if not args.families:
        raise CliError("--family needs --families")
    profile = "test" if args.profile == "test" else "standard"
    config = FAMILIES_PROFILES[profile]
    command = "hypic-rag bench --families" + (" --profile test" if profile == "test" else "")
    if args.family:
        try:
            config = config.only(args.family)
        except ValueError as error:
            raise CliError(f"--family: {error}") from None
        command += "".join(f" --family {name}" for name in args.family)
    print(f"family benchmark ({profile}); results go to {output.resolve()}", file=sys.stderr)
    result = run_families(config, command=command)
    written = write_families(result, output)
    print(families_markdown(result))
    print("written: " + ", ".join(str(path) for path in written))
    return EXIT_OK


def run_cache_formats_bench(args: argparse.Namespace, output: Path) -> None:
    """`--sections cache_formats`: every cache format side by side (`hypic_rag.bench.cache_formats`); the standard
    configuration, or `--profile test` for a tiny run."""
    from hypic_rag.bench.cache_formats import PROFILES, cache_formats_markdown, run_cache_formats, write_cache_formats

    profile = "test" if args.profile == "test" else "standard"
    command = "hypic-rag bench --sections cache_formats" + (" --profile test" if profile == "test" else "")
    print(f"cache formats benchmark ({profile}); results go to {output.resolve()}", file=sys.stderr)
    result = run_cache_formats(PROFILES[profile], command=command)
    written = write_cache_formats(result, output)
    print(cache_formats_markdown(result))
    print("written: " + ", ".join(str(path) for path in written))
