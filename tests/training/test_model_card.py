"""The model card renders from run directories: one row per stage with its steps, minutes and validation exact
match (`full`, and `hypic` where the stage measured it), steps past a stage's recorded stop left out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hypic_rag.demo.default_model import default_model_path
from training.model_card import render_card
from training.trainer import TrainSettings


def write_run(directory: Path, settings: TrainSettings, records: list[dict]) -> Path:
    directory.mkdir()
    (directory / "settings.json").write_text(settings.to_json())
    (directory / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return directory


@pytest.mark.skipif(not (default_model_path() / "config.json").is_file(), reason="bundled model missing")
def test_card_has_one_row_per_stage(tmp_path: Path) -> None:
    first = write_run(tmp_path / "stage1", TrainSettings(seed=0, total_steps=3), [
        {"step": 2, "minutes": 1.0, "validation": {"exact_match": 0.25}},
        {"step": 3, "minutes": 1.5, "validation": {"exact_match": 0.5}},
    ])
    second = write_run(tmp_path / "stage2", TrainSettings(seed=6, total_steps=10, stop_at_step=2, block_layout_share=0.5), [
        {"step": 2, "minutes": 2.0, "validation": {"exact_match": 0.75}, "validation_hypic": {"exact_match": 0.625}},
        {"step": 3, "minutes": 3.0, "validation": {"exact_match": 0.0}},  # past the stop: discarded
    ])
    card = render_card(default_model_path(), [first, second], [], "Some notes.")
    rows = [line for line in card.splitlines() if line.startswith("| stage")]
    assert rows[1].startswith("| stage1 | 3 | 2 | 0 | 50.0% |")
    assert rows[2].startswith("| stage2 | 2 | 2 | 6 | 75.0% / 62.5% |")
    assert "5 steps in 2 stage(s)" in card and "seeds below 70,000,000" in card
    assert card.rstrip().endswith("Some notes.")
