"""Cache formats on trained checkpoints: exact match with entries in each format against float32 entries (issue 28).

The test bed of `evals/recompute_policies.py`: held-out questions (worlds 900,000,000+) with the real retriever's
top k = 8 chunks, on the bundled model (trained on composed layouts) or the stage-3 checkpoint
(`evals/stage3_model/`, never trained on them). Every question is answered greedily under `hypic` (the engine's seam,
or `--policy`) from float32 entries and from the same entries stored in each format
(`hypic_rag.cache.compressed_source.CompressedSource`: compressed once, decoded as a cache hit is); per format: exact
match, its paired difference to float32 entries with a 95% interval (normal approximation of the per-question
differences), agreement of the answers, and KL(float32 entries || format) of the first answer token (mean, p99).
JSON (`--out`) and a markdown table (`--markdown`).

    OMP_WAIT_POLICY=PASSIVE python -m evals.cache_formats --model hypic_rag/demo/assets/default_model \\
        --out docs/benchmarks/cache_formats_bundled.json --markdown docs/benchmarks/cache_formats_bundled.md
    OMP_WAIT_POLICY=PASSIVE python -m evals.cache_formats --model evals/stage3_model \\
        --out docs/benchmarks/cache_formats_stage3.json --markdown docs/benchmarks/cache_formats_stage3.md
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from evals.recompute_policies import build_requests, greedy_decode, load_cases, paired_difference
from training.data.synthetic_qa import HELDOUT_SEED
from training.evaluate import EvalItem, summarize

DEFAULT_FORMATS = "bfloat16,fp8,int8,int7-kv8,int7,int6-kv8,int6,int5,int4-kv8,int4,int3"


def evaluate(engine: Any, cases: list[Any], formats: list[str], stop: str, policy: str | None,
             progress: bool = True) -> dict[str, Any]:
    """Every format on every case against float32 entries: one row per format (float32's own first)."""
    from hypic_rag.cache.compressed_source import CompressedSource
    from hypic_rag.calibration.cache_format import percentile
    from hypic_rag.runtime.engine import Engine
    from hypic_rag.runtime.quality import kl_divergence
    from training.packing import SegmentEncoder

    requests = build_requests(cases, SegmentEncoder(engine.model.tokenizer))
    engines = {name: Engine(engine.model, seam_tokens=engine.seam_tokens,
                            segment_source=CompressedSource(engine.segment_source, name, budget_bytes=4 << 30))
               for name in formats}
    answers: dict[str, list[str]] = {"float32": [], **{name: [] for name in formats}}
    kls: dict[str, list[float]] = {name: [] for name in formats}
    seconds: dict[str, float] = {name: 0.0 for name in answers}
    stored: dict[str, CompressedSource] = {name: format_engine.segment_source for name, format_engine in engines.items()}
    for request in tqdm(requests, desc="questions", file=sys.stderr, disable=not progress):
        began = time.perf_counter()
        reference = engine.prefill(request, "hypic", policy=policy)
        answers["float32"].append(greedy_decode(engine, reference.logits, reference.state, stop))
        seconds["float32"] += time.perf_counter() - began
        for name, format_engine in engines.items():
            began = time.perf_counter()
            result = format_engine.prefill(request, "hypic", policy=policy)
            answers[name].append(greedy_decode(format_engine, result.logits, result.state, stop))
            seconds[name] += time.perf_counter() - began
            kls[name].append(kl_divergence(reference.logits, result.logits))
    reference_items = [EvalItem(case.question, answer) for case, answer in zip(cases, answers["float32"])]
    reference_exact = [item.exact for item in reference_items]
    rows = {}
    for name, given in answers.items():
        items = [EvalItem(case.question, answer) for case, answer in zip(cases, given)]
        source = stored.get(name)
        ratio = (sum(source.stored_bytes.values()) / sum(source.float32_bytes.values())) if source else 1.0
        rows[name] = {
            "cache_format": name, **summarize(items),
            **_against_float32(paired_difference([item.exact for item in items], reference_exact)),
            "agreement": sum(a == b for a, b in zip(given, answers["float32"])) / len(cases),
            "mean_kl": sum(kls[name]) / len(cases) if name in kls else 0.0,
            "p99_kl": percentile(kls[name], 0.99) if name in kls else 0.0,
            "bytes_ratio": ratio, "seconds": round(seconds[name], 1),
            "exact_flags": "".join("1" if item.exact else "0" for item in items),
        }
    return {"prompt_tokens": sum(request.prompt_tokens for request in requests) / len(requests), "rows": rows}


def _against_float32(difference: dict[str, Any]) -> dict[str, Any]:
    """`paired_difference`'s keys (named for its reference, full) named for this one, float32 entries."""
    return {key.replace("full", "float32"): value for key, value in difference.items()}


def markdown_table(report: dict[str, Any]) -> str:
    lines = [f"{report['questions']} held-out questions (seed {report['seed']}), k = {report['k']}, model "
             f"`{report['model_label']}`, `hypic` with {report['policy'] or 'the fixed seam'} (seam "
             f"{report['seam_tokens']}); prompt {report['prompt_tokens']:.0f} tokens on average. Bytes: the "
             "questions' distinct entries in the format against float32 (this model's shapes). EM difference: "
             "paired against float32 entries, 95% interval (normal approximation).", "",
             "| format | bytes vs float32 | EM | EM - float32 (points) [95% paired] | same answer | KL mean | KL p99 |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in report["rows"].values():
        low, high = row["em_minus_float32_ci95"]
        lines.append(
            f"| `{row['cache_format']}` | {100 * row['bytes_ratio']:.1f}% | {100 * row['exact_match']:.1f}% | "
            f"{100 * row['em_minus_float32']:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}] | {100 * row['agreement']:.1f}% | "
            f"{row['mean_kl']:.1e} | {row['p99_kl']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from hypic_rag.demo.default_model import default_model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--model-label", default=None)
    parser.add_argument("--questions", type=int, default=500)
    parser.add_argument("--seed", type=int, default=HELDOUT_SEED)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--seam-tokens", type=int, default=8)
    parser.add_argument("--policy", default=None, help="recompute policy spec (default: the fixed seam)")
    parser.add_argument("--formats", default=DEFAULT_FORMATS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)

    from hypic_rag.runtime.engine import Engine
    from hypic_rag.runtime.model import load_model
    from training.packing import SegmentEncoder

    model = load_model(args.model, device="cpu")
    engine = Engine(model, seam_tokens=args.seam_tokens, memory_cache_bytes=4 << 30)
    stop = SegmentEncoder(model.tokenizer).prompt_format.answer_stop
    formats = [name.strip() for name in args.formats.split(",") if name.strip() and name.strip() != "float32"]
    started = time.perf_counter()
    cases = load_cases(args.seed, args.questions, model.tokenizer, args.k)
    report: dict[str, Any] = {
        "model": str(args.model), "model_label": args.model_label or args.model.name, "questions": len(cases),
        "seed": args.seed, "k": args.k, "seam_tokens": args.seam_tokens, "policy": args.policy,
        "gold_recall": sum(case.gold_retrieved for case in cases) / len(cases),
    }
    report.update(evaluate(engine, cases, formats, stop, args.policy))
    report["seconds"] = round(time.perf_counter() - started, 1)
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if args.markdown:
        args.markdown.write_text(markdown_table(report))
    print(markdown_table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
