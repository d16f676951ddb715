"""`hypic-rag bench --families` end to end on the test profile (tiny models) for two families, in a real process:
JSON and markdown written, bytes at the published checkpoints' shapes, TTFT rows whose `full` is transformers'
forward; bad `--family` use is one line and exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def bench(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "hypic_rag", "bench", *argv], capture_output=True, text=True,
                          env=env, timeout=600, check=False)


def test_families_bench_writes_bytes_and_timing_rows(tmp_path: Path) -> None:
    done = bench("--families", "--profile", "test", "--family", "lfm2", "--family", "jamba", "--output", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "families_test.json").read_text())
    markdown = (tmp_path / "families_test.md").read_text()
    assert markdown.startswith("# hypic-rag benchmark: model families (test)") and "ai21labs/Jamba-v0.1" in markdown
    assert result["command"] == "hypic-rag bench --families --profile test --family lfm2 --family jamba"
    sizes = {row["model_type"]: row for row in result["cache_bytes_per_chunk"]}
    assert set(sizes) == {"lfm2", "jamba"}
    assert sizes["jamba"]["checkpoint"] == "ai21labs/Jamba-v0.1" and sizes["jamba"]["chunk_tokens"] == 256
    assert sizes["jamba"]["bytes"]["linear_state"] > sizes["jamba"]["bytes"]["key_value"] > 0
    assert sizes["lfm2"]["bytes"]["suffix_state"] == 0 and sizes["lfm2"]["bytes"]["key_value"] > 0
    rows = {row["model_type"]: row for row in result["time_to_first_token"]}
    assert set(rows) == {"lfm2", "jamba"}
    for row in rows.values():
        medians = row["ttft_median"]
        assert set(medians) == {"transformers", "full", "hypic"} and min(medians.values()) > 0
        assert row["max_abs_logit_diff_full_vs_transformers"] < 1e-4  # full is transformers' computation
        assert row["prompt_tokens"] == 32 + 4 * 24 + 24
        assert abs(row["hypic_speedup_vs_transformers"] - medians["transformers"] / medians["hypic"]) < 1e-9
        assert row["recomputed_tokens_hypic"] < row["prompt_tokens"]
    assert "| `jamba` |" in done.stdout and "written:" in done.stdout


def test_bad_family_options_are_one_line(tmp_path: Path) -> None:
    for argv, fragment in ((["--families", "--family", "gpt2"], "unknown family 'gpt2'"),
                           (["--family", "jamba"], "--family needs --families")):
        done = bench(*argv, "--output", str(tmp_path))
        assert done.returncode == 2, done.stderr
        lines = (done.stdout + done.stderr).strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("hypic-rag bench: error: ") and fragment in lines[0], lines
