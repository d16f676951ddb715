"""Write a benchmark result as JSON, a markdown table and PNG plots."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def _format(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# hypic-rag benchmark ({result['config']['profile']})", "", f"Machine: {result['machine']}", ""]
    lines.append(f"Timing model: {result['timing_model']['description']}. Seam window {result['config']['seam_tokens']}.")
    lines.append("All figures of a table come from the same run; speedups are ratios of medians in that run.")
    for workload in result["workloads"]:
        lines += ["", f"## {workload['workload']} ({workload['requests']} requests, ~{workload['mean_prompt_tokens']:.0f} prompt tokens)", ""]
        lines.append("| mode | TTFT p50 (s) | TTFT p95 (s) | x vs full | x vs prefix | recomputed | MB loaded/req | KL vs full | greedy agree | req/s |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for mode, row in workload["modes"].items():
            throughput = row.get("throughput") or {}
            lines.append(
                f"| {mode} | {_format(row['ttft_p50'])} | {_format(row['ttft_p95'])} | {_format(row['ttft_speedup_vs_full'])} "
                f"| {_format(row.get('ttft_speedup_vs_prefix'))} | {row['recomputed_fraction']:.3f} "
                f"| {row['cache_bytes_loaded_per_request'] / 2**20:.1f} | {_format(row['kl_vs_full'])} "
                f"| {row['greedy_agreement_vs_full']:.2f} | {_format(throughput.get('requests_per_second'))} |"
            )
        if "cache_bytes_per_chunk" in workload:
            sizes = workload["cache_bytes_per_chunk"]
            lines.append("")
            lines.append(
                f"Cache bytes per {sizes['chunk_tokens']}-token chunk: {sizes['total'] / 2**20:.2f} MiB "
                f"(linear state {sizes['linear_state'] / 2**20:.2f} MiB, K/V {sizes['key_value'] / 2**20:.2f} MiB)."
            )
    if result.get("seam_sweep"):
        lines += ["", "## Seam sweep (hypic, workload rag_qa k=8)", "", "| seam | TTFT p50 (s) | recomputed | KL vs full | greedy agree |", "| --- | --- | --- | --- | --- |"]
        for row in result["seam_sweep"]:
            lines.append(f"| {row['seam_tokens']} | {_format(row['ttft_p50'])} | {row['recomputed_fraction']:.3f} | {_format(row['kl_vs_full'])} | {row['greedy_agreement_vs_full']:.2f} |")
    lines += ["", f"Reproduce: `{result['command']}` ({result['seconds']:.0f} s)."]
    return "\n".join(lines) + "\n"


def plots(result: dict[str, Any], directory: Path) -> list[Path]:
    """TTFT per mode per workload, and the seam sweep's quality against TTFT. Skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plots")
        return []
    written = []
    workloads = result["workloads"]
    figure, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.6), squeeze=False)
    for axis, workload in zip(axes[0], workloads):
        modes = list(workload["modes"])
        values = [workload["modes"][mode]["ttft_p50"] for mode in modes]
        axis.bar(range(len(modes)), values, color="#4c72b0")
        axis.set_xticks(range(len(modes)), modes, rotation=40, ha="right", fontsize=8)
        axis.set_yscale("log")
        axis.set_ylim(bottom=min(values) / 3, top=max(values) * 2)
        axis.set_title(workload["workload"], fontsize=9)
        axis.set_ylabel("TTFT p50 (s)")
    figure.tight_layout()
    path = directory / f"ttft_by_mode_{result['config']['profile']}.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    written.append(path)
    if result.get("seam_sweep"):
        rows = result["seam_sweep"]
        figure, axis = plt.subplots(figsize=(5, 3.6))
        axis.plot([r["ttft_p50"] for r in rows], [r["kl_vs_full"] for r in rows], "o-")
        for r in rows:
            axis.annotate(f"w={r['seam_tokens']}", (r["ttft_p50"], r["kl_vs_full"]), fontsize=8)
        axis.set_xlabel("TTFT p50 (s)")
        axis.set_ylabel("KL(full || hypic)")
        axis.set_title("seam window: quality vs time to first token", fontsize=9)
        figure.tight_layout()
        path = directory / f"seam_sweep_{result['config']['profile']}.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written


def write_report(result: dict[str, Any], directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    json_path = directory / f"bench_{result['config']['profile']}.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    markdown_path = directory / f"bench_{result['config']['profile']}.md"
    markdown_path.write_text(markdown(result))
    return [json_path, markdown_path, *plots(result, directory)]
