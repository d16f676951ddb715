"""Benchmark plots drawn from the saved results in docs/benchmarks: titled, naming model, machine and profile,
bars labelled with speed-ups, axes from zero, no label drawn over another; and the exact-match plot per mode."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from hypic_rag.bench.quality_plot import load_results, quality_figure, wilson_interval
from hypic_rag.bench.report import (
    seam_figure,
    speedup_label,
    ttft_figure,
    workload_title,
)

REPOSITORY = Path(__file__).resolve().parents[2]
BENCHMARKS = REPOSITORY / "docs" / "benchmarks"
PROFILES = ("quick", "standard")


def saved(profile: str) -> dict:
    return json.loads((BENCHMARKS / f"bench_{profile}.json").read_text())


def texts_of(figure) -> list[str]:
    return [text.get_text() for text in figure.findobj(matplotlib.text.Text) if text.get_text()]


def assert_no_overlap(figure, texts) -> None:
    """No two of `texts` (drawn, non-empty) share any pixel."""
    renderer = figure.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts if t.get_text() and t.get_visible()]
    for (first, a), (second, b) in itertools.combinations(boxes, 2):
        assert not a.overlaps(b), f"{first!r} overlaps {second!r}"


def test_names_and_speedup_labels() -> None:
    assert workload_title("rag_qa_k8") == "RAG question answering, 8 chunks"
    assert workload_title("long_context_12x128") == "Long context, 12 chunks of 128 tokens"
    assert workload_title("cold_k8") == "Cold cache (nothing cached), 8 chunks"
    assert workload_title("something_new") == "something_new"
    assert (speedup_label(1.0), speedup_label(4.57), speedup_label(1.029), speedup_label(0.608)) == (
        "baseline", "4.6x faster", "1.03x faster", "1.64x slower")


@pytest.mark.parametrize("profile", PROFILES)
def test_ttft_figure_is_titled_labelled_and_honest(profile: str) -> None:
    result = saved(profile)
    figure = ttft_figure(result, plt)
    try:
        texts = texts_of(figure)
        assert f"profile '{profile}'" in figure._suptitle.get_text()
        note = next(text for text in texts if text.startswith("model: "))
        assert result["timing_model"]["description"] in note and result["machine"] in note
        axes = [axis for axis in figure.axes if axis.get_visible()]
        assert len(axes) == len(result["workloads"])
        for axis, workload in zip(axes, result["workloads"]):
            assert axis.get_title().startswith(workload_title(workload["workload"]))
            assert axis.get_xscale() == "linear" and axis.get_xlim()[0] == 0  # bars from zero
            labels = [text.get_text() for text in axis.texts]
            assert len(labels) == len(workload["modes"])
            for label, (mode, row) in zip(labels, workload["modes"].items()):
                assert label.startswith(f"{row['ttft_p50']:.3g} s"), (mode, label)
                assert speedup_label(row["ttft_speedup_vs_full"]) in label
            assert_no_overlap(figure, list(axis.texts) + axis.get_yticklabels())
            assert max(text.get_window_extent(figure.canvas.get_renderer()).x1 for text in axis.texts) <= \
                axis.get_window_extent(figure.canvas.get_renderer()).x1  # labels inside their panel
        assert_no_overlap(figure, [axis.title for axis in axes] + [figure._suptitle])
    finally:
        plt.close(figure)


@pytest.mark.parametrize("profile", PROFILES)
def test_seam_figure_starts_its_axes_at_zero_without_crowding(profile: str) -> None:
    result = saved(profile)
    figure = seam_figure(result, plt)
    try:
        assert f"profile '{profile}'" in figure._suptitle.get_text()
        kl_axis, ttft_axis = figure.axes
        for axis in (kl_axis, ttft_axis):
            assert axis.get_ylim()[0] == 0  # 0.153 -> 0.148 must not look like a fall
            assert_no_overlap(figure, axis.get_xticklabels() + list(axis.texts))
        kl = [row["kl_vs_full"] for row in result["seam_sweep"]]
        assert [text.get_text().split("\n")[0] for text in kl_axis.texts] == [f"{value:.3f}" for value in kl]
        assert any(result["machine"] in text for text in texts_of(figure))
    finally:
        plt.close(figure)


def test_quality_figure_shows_exact_match_per_mode_from_zero() -> None:
    results = load_results(BENCHMARKS)
    assert len(results) >= 1 and results[0]["context"] == "retriever" and results[0]["k"] == 8
    figure = quality_figure(results, plt)
    try:
        assert "exact match" in figure._suptitle.get_text() and "default model" in figure._suptitle.get_text()
        for axis, result in zip(figure.axes, results):
            assert axis.get_ylim()[0] == 0 and axis.get_ylim()[1] >= 100
            labels = [text.get_text() for text in axis.texts]
            expected = {f"{100 * row['exact_match']:.1f}%" for row in result["modes"].values()}
            assert set(labels) == expected and len(labels) == len(result["modes"])
            assert_no_overlap(figure, axis.get_xticklabels() + list(axis.texts))
    finally:
        plt.close(figure)
    low, high = wilson_interval(483, 500)
    assert 0.945 < low < 0.966 < high < 0.98


def test_the_plots_are_redrawn_from_saved_results(tmp_path: Path) -> None:
    shutil.copy(BENCHMARKS / "bench_quick.json", tmp_path / "bench_quick.json")
    for path in BENCHMARKS.glob("default_model_quality*.json"):
        shutil.copy(path, tmp_path / path.name)
    env = {**os.environ, "PYTHONPATH": str(REPOSITORY), "OMP_WAIT_POLICY": "PASSIVE"}
    for module, args in (("hypic_rag.bench.report", [str(tmp_path / "bench_quick.json")]),
                         ("hypic_rag.bench.quality_plot", ["--results", str(tmp_path)])):
        done = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env, check=False,
                              timeout=120)
        assert done.returncode == 0, done.stderr
    for name in ("ttft_by_mode_quick.png", "seam_sweep_quick.png", "default_model_exact_match.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / name).stat().st_size > 20_000
    done = subprocess.run([sys.executable, "-m", "hypic_rag.bench.quality_plot", "--results", str(tmp_path / "none")],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 2 and "no default_model_quality*.json file" in done.stderr
