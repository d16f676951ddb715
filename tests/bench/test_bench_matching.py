"""The matching benchmark finds every pasted chunk (its full run: `python -m hypic_rag.bench.matching`)."""

from __future__ import annotations

from hypic_rag.bench.matching import measure


def test_matching_benchmark_finds_every_pasted_chunk() -> None:
    result = measure(known_counts=(40, 120), pasted=(1, 5), repeats=1)
    assert [(row["known_chunks"], row["pasted_chunks"]) for row in result["rows"]] == [(40, 1), (40, 5), (120, 1),
                                                                                       (120, 5)]
    assert all(row["matches"] == row["pasted_chunks"] and row["find_ms"] >= 0 for row in result["rows"])
