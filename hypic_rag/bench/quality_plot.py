"""Exact match per composition mode on the bundled default model, drawn from saved evaluation results.

    python -m hypic_rag.bench.quality_plot            # docs/benchmarks/default_model_quality*.json ->
                                                      # docs/benchmarks/default_model_exact_match.png

Each results file (written by `evals/eval_default_model.py`) is one panel: a bar per mode, on an axis from 0 to
100% (the modes differ by a few points; a truncated axis would make that look large), each bar labelled with its
exact match and drawn with its 95% Wilson interval over the file's questions, so differences within the noise
read as such.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_DIRECTORY = Path("docs/benchmarks")
DEFAULT_PATTERN = "default_model_quality*.json"
DEFAULT_OUTPUT = "default_model_exact_match.png"
MODE_ORDER = ("hf", "full", "prefix", "addition", "transition", "transition_rope", "hypic")
MODE_NOTES = {"hf": "hf\n(transformers)", "full": "full\n(recompute)"}
Z_95 = 1.959963984540054


def wilson_interval(successes: float, trials: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval (low, high) of a proportion `successes / trials`; (0, 1) for no trials."""
    if trials <= 0:
        return 0.0, 1.0
    p = successes / trials
    denominator = 1.0 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def panel_title(result: dict[str, Any]) -> str:
    """What a results file measured, in words."""
    context = result.get("context", "?")
    if context == "retriever":
        hop = f", {result['hop_slots']} hop places" if result.get("hop_slots") else ""
        where = f"real retriever, k = {result['k']}{hop}"
    elif context == "distractors":
        where = f"gold + random distractors, k = {result['k']}"
    else:
        where = f"{context}, k = {result.get('k', '?')}"
    recall = result.get("gold_recall")
    recall_note = f"\ngold documents in context: {recall:.1%}" if isinstance(recall, float) else ""
    return f"{where}\n{result['questions']} questions{recall_note}"


def quality_figure(results: list[dict[str, Any]], plt: Any) -> Any:
    """One panel per results dict: exact match per mode with 95% intervals, axes 0-100%."""
    widths = [max(2, len(result["modes"])) for result in results]
    figure, axes = plt.subplots(1, len(results), figsize=(1.1 * sum(widths) + 1.5, 5.4), squeeze=False,
                                gridspec_kw={"width_ratios": widths})
    for axis, result in zip(axes[0], results):
        modes = sorted(result["modes"], key=lambda m: MODE_ORDER.index(m) if m in MODE_ORDER else len(MODE_ORDER))
        values = [100.0 * result["modes"][mode]["exact_match"] for mode in modes]
        counts = [int(result["modes"][mode].get("num_questions", result["questions"])) for mode in modes]
        intervals = [wilson_interval(v / 100.0 * n, n) for v, n in zip(values, counts)]
        errors = [[v - 100.0 * low for v, (low, _) in zip(values, intervals)],
                  [100.0 * high - v for v, (_, high) in zip(values, intervals)]]
        colours = ["#dd8452" if mode == "hypic" else "#9a9a9a" if mode in ("full", "hf") else "#4c72b0"
                   for mode in modes]
        positions = list(range(len(modes)))
        axis.bar(positions, values, color=colours, width=0.65, yerr=errors, capsize=3,
                 error_kw={"elinewidth": 0.8, "ecolor": "#333333"})
        for position, value, (_, high) in zip(positions, values, intervals):
            axis.text(position, 100.0 * high + 1.0, f"{value:.1f}%", ha="center", va="bottom", fontsize=8)
        axis.set_ylim(0, 112)
        axis.set_yticks(range(0, 101, 20))
        axis.set_xticks(positions, [MODE_NOTES.get(mode, mode) for mode in modes], fontsize=8)
        axis.set_title(panel_title(result), fontsize=9)
        axis.spines[["top", "right"]].set_visible(False)
    axes[0][0].set_ylabel("exact match (%)")
    first = results[0]
    figure.suptitle("Answer quality per composition mode: exact match on the bundled default model",
                    fontsize=12, fontweight="bold")
    note = (f"model: {first.get('model', 'the default model')} (the bundled qwen3_5 hybrid trained on synthetic "
            f"multi-document QA; see its MODEL_CARD.md)\nheld-out questions, seed {first.get('seed', '?')}, two-hop share "
            f"{first.get('two_hop_share', '?')}, seam {first.get('seam_tokens', '?')} tokens, greedy decoding\n"
            "whiskers: 95% Wilson interval over the questions; exact match does not depend on the machine "
            "(timings do: see ttft_by_mode_*.png)")
    figure.text(0.5, 0.01, note, ha="center", va="bottom", fontsize=8, color="#444444")
    figure.tight_layout(rect=(0, 0.7 / figure.get_figheight(), 1, 1))
    return figure


def load_results(directory: Path, pattern: str = DEFAULT_PATTERN) -> list[dict[str, Any]]:
    """The results files of `directory` matching `pattern`: the real retriever's first (more context chunks
    first), then the others by name."""
    results = [(path.name, json.loads(path.read_text())) for path in sorted(directory.glob(pattern))]
    results.sort(key=lambda item: (item[1].get("context") != "retriever", -int(item[1].get("k") or 0), item[0]))
    return [result for _, result in results]


def write_quality_plot(results: list[dict[str, Any]], output: Path) -> Path | None:
    """Draw `results` into `output` (PNG); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot")
        return None
    figure = quality_figure(results, plt)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=110)
    plt.close(figure)
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hypic_rag.bench.quality_plot",
                                     description="Plot exact match per mode from saved default-model evaluations.")
    parser.add_argument("--results", type=Path, default=DEFAULT_DIRECTORY, metavar="DIR",
                        help=f"folder of {DEFAULT_PATTERN} files ({DEFAULT_DIRECTORY})")
    parser.add_argument("--output", type=Path, metavar="PNG", help=f"default: DIR/{DEFAULT_OUTPUT}")
    args = parser.parse_args(argv)
    results = load_results(args.results)
    if not results:
        parser.error(f"no {DEFAULT_PATTERN} file in {args.results}")
    written = write_quality_plot(results, args.output or args.results / DEFAULT_OUTPUT)
    if written is None:
        parser.error("matplotlib is not installed (pip install 'hypic-rag[bench]')")
    print(written)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
