"""`hypic-rag bench --sections cache_formats --profile test`: every part runs (bytes at a published family's shapes,
KL on a tiny model, load time, hypic TTFT from LMDB) and the report's numbers hang together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hypic_rag.cli.main import main


def test_the_cache_formats_section_writes_every_part(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--sections", "cache_formats", "--profile", "test", "--output", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "cache_formats_test.json").read_text())
    assert result["command"] == "hypic-rag bench --sections cache_formats --profile test"
    (row,) = result["bytes"]  # lfm2 at its published shapes, a bfloat16 model, 64 tokens
    assert row["model_type"] == "lfm2" and row["model_dtype"] == "bfloat16"
    assert row["ratio"]["float32"] == 1 and 0 < row["ratio"]["int4"] < row["ratio"]["int8"] < 0.6  # K/V: bf16 -> 8/4 bits
    (quality,) = result["quality"]
    kl = {name: quality["formats"][name]["mean_kl"] for name in ("int8", "int4")}
    assert 0 <= kl["int8"] < kl["int4"]  # fewer bits, further from float32 entries
    load = {row["cache_format"]: row for row in result["load"]}
    assert load["int4"]["value_bytes"] < load["int8"]["value_bytes"] < load["float32"]["value_bytes"]
    assert all(row["disk_cold_ms"] > 0 and row["decode_ms"] >= 0 for row in load.values())
    ttft = {row["cache_format"]: row for row in result["ttft"]["rows"]}
    assert ttft["float32"]["warm_vs_float32"] == 1 and ttft["float32"]["kl_vs_float32"] == 0
    assert all(row["warm_ms"] > 0 and row["cold_ms"] > 0 for row in ttft.values())
    assert ttft["int8"]["kl_vs_float32"] < ttft["int4"]["kl_vs_float32"]
    sizes = result["ttft"]["value_bytes_per_request"]
    assert sizes["int4"] < sizes["int8"] < sizes["float32"]
    markdown = (tmp_path / "cache_formats_test.md").read_text()
    assert "## Bytes per 64-token chunk, model in bfloat16" in markdown and "| `lfm2` |" in markdown
    assert "time to first token from an LMDB cache" in markdown and "written:" in capsys.readouterr().out
