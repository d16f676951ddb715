"""The query-embedder benchmark times both backends side by side (its full run:
`OMP_WAIT_POLICY=PASSIVE python -m hypic_rag.bench.embedder_speed`)."""

from __future__ import annotations

import pytest

from hypic_rag.bench.embedder_speed import main, measure, questions


def test_the_embedder_benchmark_times_both_backends_in_process() -> None:
    result = measure(query_count=3, batch_count=1, batch_size=2, fresh_runs=0)
    assert result["fresh_process"] is None and result["queries"] == 3
    for row in (result["in_process"]["single_query_ms"], result["in_process"]["batch_of_2_ms"]):
        assert row["light"] > 0 and row["transformers"] > 0
        assert row["transformers_over_light"] == round(row["transformers"] / row["light"], 3)
    assert len(set(questions(50))) == 50


def test_the_embedder_benchmark_refuses_a_non_positive_count(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--queries", "0"])
    assert exit_info.value.code == 2 and "--queries" in capsys.readouterr().err
