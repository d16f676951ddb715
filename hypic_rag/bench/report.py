"""Write a benchmark result as JSON, a markdown table and PNG plots.

`python -m hypic_rag.bench.report docs/benchmarks/bench_*.json` draws the plots again from saved results (next to
each JSON file), without running anything.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
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
    if result.get("machine_rates"):
        rates = result["machine_rates"]
        lines.append(
            f"Measured at the start of the run: fp32 matmul {rates['matmul_flops_per_second'] / 1e9:.0f} GFLOP/s, copy "
            f"{rates['copy_bytes_per_second'] / 1e9:.1f} GB/s; `x floor` = TTFT / (recomputed FLOPs / matmul rate + "
            "cache bytes loaded / copy rate)."
        )
    lines.append("All figures of a table come from the same run; speedups are ratios of medians in that run.")
    for workload in result["workloads"]:
        lines += ["", f"## {workload['workload']} ({workload['requests']} requests, ~{workload['mean_prompt_tokens']:.0f} prompt tokens)", ""]
        lines.append("| mode | TTFT p50 (s) | TTFT p95 (s) | x vs transformers | x vs full | x vs prefix | x floor | recomputed | MB loaded/req | KL vs full | greedy agree | req/s |")
        lines.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for mode, row in workload["modes"].items():
            throughput = row.get("throughput") or {}
            lines.append(
                f"| {mode} | {_format(row['ttft_p50'])} | {_format(row['ttft_p95'])} "
                f"| {_format(row.get('ttft_speedup_vs_transformers'))} | {_format(row['ttft_speedup_vs_full'])} "
                f"| {_format(row.get('ttft_speedup_vs_prefix'))} | {_format(row.get('times_floor'))} | {row['recomputed_fraction']:.3f} "
                f"| {row['cache_bytes_loaded_per_request'] / 2**20:.1f} | {_format(row['kl_vs_full'])} "
                f"| {row['greedy_agreement_vs_full']:.2f} | {_format(throughput.get('requests_per_second'))} |"
            )
        if "encoding" in workload:
            encoding = workload["encoding"]
            lines.append("")
            lines.append(
                f"Encoding {encoding['chunks']} chunks ({encoding['tokens']} tokens) into cache entries: "
                f"{encoding['encode_tokens_per_second']:.0f} tokens/s; transformers' forward of the same chunks: "
                f"{encoding['transformers_forward_tokens_per_second']:.0f} tokens/s "
                f"({encoding['ratio_vs_transformers']:.2f}x)."
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
    lines += throughput_markdown(result.get("throughput") or {})
    lines += ["", f"Reproduce: `{result['command']}` ({result['seconds']:.0f} s)."]
    return "\n".join(lines) + "\n"


THROUGHPUT_TITLES = {
    "engine": "Continuous batching on the timing model (RAG k = 8, warm cache, hypic, answers of {new_tokens} tokens)",
    "server": "Continuous batching through the service (bundled default model, example corpus, {endpoint}, "
              "max_new_tokens {new_tokens})",
}


def throughput_markdown(throughput: dict[str, Any]) -> list[str]:
    """The throughput section's tables: per client count, batched and one at a time, and their ratios; the modes
    under the same load; a row per recurrent mixer kind."""
    lines: list[str] = []
    for name, section in throughput.items():
        if name == "modes":
            lines += modes_throughput_markdown(section)
            continue
        if name == "families":
            lines += family_throughput_markdown(section)
            continue
        if name in ("server_clients", "server_clients_workers"):
            lines += server_clients_markdown(section)
            continue
        lines += ["", f"## {THROUGHPUT_TITLES[name].format(**section)}", ""]
        lines.append("Closed loop: each client sends its next request when its answer is complete; TTFT and latency "
                     "are measured by the client (queue wait included); each cell's runs alternate with the other "
                     "way's.")
        lines += ["", "| clients | serving | completed | req/s | TTFT p50 (s) | TTFT p95 (s) | latency p50 (s) "
                  "| tokens/answer |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for way, label in (("one_at_a_time", "one at a time"), ("batched", "batched")):
            for cell in section[way]:
                lines.append(
                    f"| {cell['clients']} | {label} (max running {cell['max_running']}) | {cell['completed']} "
                    f"| {_format(cell['requests_per_second'])} | {_format(cell['ttft_p50'])} | {_format(cell['ttft_p95'])} "
                    f"| {_format(cell['latency_p50'])} | {cell['mean_completion_tokens']:.1f} |"
                )
        lines += ["", "| clients | batched / one at a time, req/s | one at a time / batched, TTFT p50 |", "| --- | --- | --- |"]
        for row in section["comparison"]:
            lines.append(f"| {row['clients']} | {_format(row['requests_per_second_ratio'])}x "
                         f"| {_format(row['ttft_p50_ratio'])}x |")
    return lines


def server_clients_markdown(section: dict[str, Any]) -> list[str]:
    """One server, one client against concurrent clients (`bench/server_clients.py`): both cells and their ratio,
    and how many concurrent answers differed from the same question asked alone."""
    workers = int(section.get("workers", 1))
    served = f"`serve --workers {workers}`" if workers > 1 else "one server process"
    lines = ["", f"## Through the service ({served}), one client against {section['concurrent']['clients']} "
             f"(bundled default model, {section['corpus']}, {section['endpoint']}, max_new_tokens "
             f"{section['new_tokens']})", "",
             "| clients | completed | req/s | TTFT p50 (s) | latency p50 (s) | tokens/answer |",
             "| --- | --- | --- | --- | --- | --- |"]
    for cell in (section["one_client"], section["concurrent"]):
        lines.append(f"| {cell['clients']} | {cell['completed']} | {_format(cell['requests_per_second'])} "
                     f"| {_format(cell['ttft_p50'])} | {_format(cell['latency_p50'])} "
                     f"| {cell['mean_completion_tokens']:.1f} |")
    lines += ["", f"Requests/s ratio: {_format(section['requests_per_second_ratio'])}x; answers differing from the same "
              f"question asked alone: {section['mismatches']} of {section['answers_compared']}."]
    return lines


def modes_throughput_markdown(section: dict[str, Any]) -> list[str]:
    """`hypic`, `prefix` and `full` under the same closed-loop load: a cell per mode and client count, and hypic's
    ratios against the others."""
    modes = list(section["modes"])
    lines = ["", f"## Modes under the same load (timing model, RAG k = 8, chunks from a shared pool, batched, answers "
             f"of {section['new_tokens']} tokens)", "",
             "Closed loop, `max_running` = the clients; prefix mode reuses the chunk-boundary checkpoints earlier "
             "requests left (it hits only where a request's first chunks repeat); each cell's runs alternate with "
             "the other modes'.",
             "", "| clients | mode | completed | req/s | TTFT p50 (s) | TTFT p95 (s) | latency p50 (s) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for index in range(len(section["modes"][modes[0]])):
        for mode in modes:
            cell = section["modes"][mode][index]
            lines.append(f"| {cell['clients']} | {mode} | {cell['completed']} | {_format(cell['requests_per_second'])} "
                         f"| {_format(cell['ttft_p50'])} | {_format(cell['ttft_p95'])} | {_format(cell['latency_p50'])} |")
    others = [mode for mode in modes if mode != "hypic"]
    if section["comparison"] and others:
        lines += ["", "| clients | " + " | ".join(f"hypic / {mode}, req/s | {mode} / hypic, TTFT p50" for mode in others)
                  + " |", "| --- |" + " --- | --- |" * len(others)]
        for row in section["comparison"]:
            cells = " | ".join(f"{_format(row[f'requests_per_second_vs_{mode}'])}x | {_format(row[f'ttft_p50_vs_{mode}'])}x"
                               for mode in others)
            lines.append(f"| {row['clients']} | {cells} |")
    return lines


def family_throughput_markdown(section: dict[str, Any]) -> list[str]:
    """A row per recurrent mixer kind: batched against one at a time on its family's timing model."""
    rows = section["rows"]
    if not rows:
        return []
    clients = rows[0]["batched"][0]["clients"]
    lines = ["", f"## Continuous batching per mixer kind (each family's random timing model, RAG k = 8 x "
             f"{section['chunk_tokens']}, hypic, {clients} clients)", "",
             "| family | mixer | parameters | one at a time, req/s | batched, req/s | batched / one at a time "
             "| TTFT p50 one at a time / batched |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        alone, batched, ratio = row["one_at_a_time"][0], row["batched"][0], row["comparison"][0]
        size = f"{_format(row['parameters'] / 1e6)}M" + (" (tiny)" if row["tiny"] else "")
        lines.append(f"| {row['model_type']} | {row['mixer']} | {size} | {_format(alone['requests_per_second'])} "
                     f"| {_format(batched['requests_per_second'])} | {_format(ratio['requests_per_second_ratio'])}x "
                     f"| {_format(ratio['ttft_p50_ratio'])}x |")
    return lines


WORKLOAD_TITLES = (
    (re.compile(r"^rag_qa_k(\d+)$"), "RAG question answering, {0} chunks"),
    (re.compile(r"^long_context_(\d+)x(\d+)$"), "Long context, {0} chunks of {1} tokens"),
    (re.compile(r"^agentic_(\d+)turns$"), "Agentic loop, {0} turns"),
    (re.compile(r"^cold_k(\d+)$"), "Cold cache (nothing cached), {0} chunks"),
)
BASELINE_COLOUR, MODE_COLOUR, HYPIC_COLOUR = "#9a9a9a", "#4c72b0", "#dd8452"


def workload_title(workload_id: str) -> str:
    """A reader's name for a workload id ("rag_qa_k8" -> "RAG question answering, 8 chunks"); the id otherwise."""
    for pattern, title in WORKLOAD_TITLES:
        match = pattern.match(workload_id)
        if match:
            return title.format(*match.groups())
    return workload_id


def speedup_label(speedup: float | None) -> str:
    """"4.6x faster" / "1.6x slower" than full recompute; "baseline" for 1.0 exactly (full itself)."""
    if speedup is None or math.isnan(speedup) or speedup <= 0:
        return ""
    if speedup == 1.0:
        return "baseline"
    ratio = speedup if speedup >= 1.0 else 1.0 / speedup
    digits = 2 if ratio < 2.0 else 1  # 1.03x, not a rounded "1.0x faster"
    return f"{ratio:.{digits}f}x " + ("faster" if speedup >= 1.0 else "slower")


def figure_note(result: dict[str, Any]) -> str:
    """The model / machine / profile line every benchmark figure carries."""
    return (f"model: {result['timing_model']['description']}\nmachine: {result['machine']}\n"
            f"profile '{result['config']['profile']}', seam window {result['config']['seam_tokens']} tokens; "
            f"reproduce: {result['command']}")


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plots")
        return None
    return plt


def ttft_figure(result: dict[str, Any], plt: Any) -> Any:
    """Horizontal bars of TTFT p50 per mode, one panel per workload, on linear axes from 0; each bar labelled with
    its time and its speed-up over full recompute in the same run."""
    workloads = result["workloads"]
    columns = min(3, len(workloads))
    rows = -(-len(workloads) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(max(8.0, 5.6 * columns), 1.3 + 3.0 * rows), squeeze=False)
    for axis in axes.flat[len(workloads):]:
        axis.set_visible(False)
    for axis, workload in zip(axes.flat, workloads):
        modes = list(workload["modes"])
        values = [workload["modes"][mode]["ttft_p50"] for mode in modes]
        colours = [BASELINE_COLOUR if mode == "full" else HYPIC_COLOUR if mode == "hypic" else MODE_COLOUR
                   for mode in modes]
        positions = range(len(modes))
        axis.barh(positions, values, color=colours, height=0.7)
        axis.set_yticks(list(positions), modes, fontsize=9)
        axis.invert_yaxis()  # first mode on top
        axis.set_xlim(0, max(values) * 1.62)
        for position, mode, value in zip(positions, modes, values):
            speed = speedup_label(workload["modes"][mode].get("ttft_speedup_vs_full"))
            axis.text(value + max(values) * 0.02, position, f"{value:.3g} s" + (f"  ({speed})" if speed else ""),
                      va="center", fontsize=8)
        axis.set_xlabel("time to first token, median (s)", fontsize=9)
        plural = "s" if workload["requests"] != 1 else ""
        axis.set_title(f"{workload_title(workload['workload'])}\n{workload['requests']} request{plural}, "
                       f"~{workload['mean_prompt_tokens']:.0f} prompt tokens", fontsize=10)
        axis.tick_params(axis="x", labelsize=8)
        axis.spines[["top", "right"]].set_visible(False)
    figure.suptitle(f"Time to first token by composition mode, profile '{result['config']['profile']}'\n"
                    "(lower is better; speed-ups against full recompute in the same run)", fontsize=12,
                    fontweight="bold")
    figure.text(0.5, 0.01, figure_note(result), ha="center", va="bottom", fontsize=8, color="#444444")
    figure.tight_layout(rect=(0, 0.7 / figure.get_figheight(), 1, 1))  # the note's three lines below; tight_layout
    # leaves room for the title itself
    return figure


def seam_figure(result: dict[str, Any], plt: Any) -> Any:
    """The seam-window sweep: KL to full recompute and TTFT per window, side by side, both axes from 0."""
    rows = result["seam_sweep"]
    labels = [f"{row['seam_tokens']}\n{row['recomputed_fraction']:.0%}" for row in rows]
    positions = list(range(len(rows)))
    figure, (kl_axis, ttft_axis) = plt.subplots(1, 2, figsize=(max(11.5, 1.9 * len(rows) + 1.5), 5.2))
    panels = (
        (kl_axis, [row["kl_vs_full"] for row in rows], "KL(full || hypic), next-token (lower is closer)",
         "Quality: distance to full recompute", "{:.3f}"),
        (ttft_axis, [row["ttft_p50"] for row in rows], "time to first token, median (s)",
         "Cost: time to first token", "{:.2f} s"),
    )
    for axis, values, ylabel, title, fmt in panels:
        axis.bar(positions, values, color=HYPIC_COLOUR, width=0.6)
        axis.set_ylim(0, max(values) * 1.18)
        for position, value, row in zip(positions, values, rows):
            text = fmt.format(value)
            if axis is kl_axis:
                text += f"\nagree {row['greedy_agreement_vs_full']:.0%}"
            axis.text(position, value + max(values) * 0.015, text, ha="center", va="bottom", fontsize=8)
        axis.set_xticks(positions, labels, fontsize=8)
        axis.set_xlabel("seam window: tokens recomputed at each chunk boundary\n(below: share of the prompt recomputed)",
                        fontsize=9)
        axis.set_ylabel(ylabel, fontsize=9)
        axis.set_title(title, fontsize=10)
        axis.spines[["top", "right"]].set_visible(False)
    figure.suptitle(f"Seam window sweep, profile '{result['config']['profile']}': hypic mode, RAG question "
                    "answering with 8 chunks", fontsize=12, fontweight="bold")
    requests = result["config"].get("sweep_requests")
    per_window = f" ({requests} requests per window)" if requests else ""
    figure.text(0.5, 0.01, figure_note(result) + f"\n'agree': share of requests whose greedy next token equals full "
                f"recompute's{per_window}",
                ha="center", va="bottom", fontsize=8, color="#444444")
    figure.tight_layout(rect=(0, 0.95 / figure.get_figheight(), 1, 1))
    return figure


def plots(result: dict[str, Any], directory: Path) -> list[Path]:
    """TTFT per mode per workload, and the seam sweep's quality and TTFT per window. Skipped without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return []
    written = []
    profile = result["config"]["profile"]
    figures = [(f"ttft_by_mode_{profile}.png", ttft_figure)] if result.get("workloads") else []
    if result.get("seam_sweep"):
        figures.append((f"seam_sweep_{profile}.png", seam_figure))
    for name, draw in figures:
        figure = draw(result, plt)
        path = directory / name
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written


def write_json_and_markdown(result: dict[str, Any], directory: Path, stem: str, text: str) -> list[Path]:
    """`<stem>.json` (the result) and `<stem>.md` (`text`) in `directory` (created); their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    json_path = directory / f"{stem}.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    markdown_path = directory / f"{stem}.md"
    markdown_path.write_text(text)
    return [json_path, markdown_path]


def write_report(result: dict[str, Any], directory: Path) -> list[Path]:
    name = f"bench_{result['config']['profile']}{result.get('file_suffix', '')}"
    return [*write_json_and_markdown(result, directory, name, markdown(result)), *plots(result, directory)]


def main(argv: list[str] | None = None) -> int:
    """Redraw the PNG plots of saved benchmark results."""
    parser = argparse.ArgumentParser(prog="python -m hypic_rag.bench.report", description=main.__doc__)
    parser.add_argument("results", nargs="+", type=Path, metavar="JSON", help="bench_<profile>.json files")
    args = parser.parse_args(argv)
    for path in args.results:
        for written in plots(json.loads(path.read_text()), path.parent):
            print(written)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
