"""`hypic-rag bench` end to end on the test profile: JSON shape and sanity, markdown and plots written."""

from __future__ import annotations

import json
import subprocess
import sys

from hypic_rag.runtime.modes import MODES


def test_bench_end_to_end(tmp_path) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "hypic_rag.cli.main", "bench", "--profile", "test", "--output", str(tmp_path), "--no-progress"],
        capture_output=True, text=True, timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "| hypic |" in completed.stdout
    result = json.loads((tmp_path / "bench_test.json").read_text())
    assert (tmp_path / "bench_test.md").read_text().startswith("# hypic-rag benchmark")
    assert (tmp_path / "ttft_by_mode_test.png").stat().st_size > 1000
    seam = result["config"]["seam_tokens"]
    names = [w["workload"] for w in result["workloads"]]
    encoding = result["workloads"][0]["encoding"]
    assert encoding["tokens"] > 0 and encoding["encode_tokens_per_second"] > 0
    assert encoding["transformers_forward_tokens_per_second"] > 0
    rates = result["machine_rates"]
    assert rates["matmul_flops_per_second"] > 1e8 and rates["copy_bytes_per_second"] > 1e8
    assert names[0].startswith("rag_qa") and any(n.startswith("long_context") for n in names)
    assert any(n.startswith("agentic") for n in names) and any(n.startswith("cold") for n in names)
    for workload in result["workloads"]:
        rows = workload["modes"]
        assert set(rows) == set(MODES) | {"transformers"}
        # transformers' own forward of the same prompt is the baseline: the same next-token distribution as full
        assert rows["transformers"]["kl_vs_full"] < 1e-4 and rows["transformers"]["recomputed_fraction"] == 1.0
        for row in rows.values():
            assert row["ttft_speedup_vs_transformers"] > 0 and row["times_floor"] > 0
            assert row["floor_seconds_p50"] > 0
        assert rows["full"]["recomputed_fraction"] == 1.0
        assert rows["full"]["kl_vs_full"] == 0.0
        for row in rows.values():
            assert row["ttft_p50"] > 0 and row["ttft_p95"] >= row["ttft_p50"]
        if workload["workload"].startswith("rag_qa"):
            # hypic recomputes exactly its seams (chunks after the prefix) and the question
            k = int(workload["workload"].split("_k")[1])
            prompt = workload["mean_prompt_tokens"]
            question = 24
            chunk = result["config"]["chunk_tokens"]
            expected = (k * min(seam, chunk) + question) / prompt
            assert abs(rows["hypic"]["recomputed_fraction"] - expected) < 1e-9
            assert abs(rows["transition_rope"]["recomputed_fraction"] - question / prompt) < 1e-9
            assert rows["hypic"]["cache_bytes_loaded_per_request"] > 0
            assert rows["hypic"]["throughput"]["completed"] >= 1
    sweep = {row["seam_tokens"]: row for row in result["seam_sweep"]}
    assert sweep[0]["recomputed_fraction"] < sweep[4]["recomputed_fraction"]
    # continuous batching against one request at a time, per client count, with the answer length asked for
    engine = result["throughput"]["engine"]
    assert "server" not in result["throughput"]  # the test profile leaves the bundled-model server out
    clients = list(result["config"]["batching_clients"])
    for way, running in (("batched", clients), ("one_at_a_time", [1] * len(clients))):
        assert [cell["clients"] for cell in engine[way]] == clients
        assert [cell["max_running"] for cell in engine[way]] == running
        for cell in engine[way]:
            assert cell["completed"] >= 1 and cell["failed"] == 0 and cell["requests_per_second"] > 0
            assert cell["mean_completion_tokens"] == engine["new_tokens"] == 16
            assert 0 < cell["ttft_p50"] <= cell["ttft_p95"] and cell["ttft_p50"] <= cell["latency_p50"]
    assert [row["clients"] for row in engine["comparison"]] == clients
    # hypic, prefix and full under the same closed-loop load, batched
    modes = result["throughput"]["modes"]
    assert list(modes["modes"]) == ["hypic", "prefix", "full"]
    for cells in modes["modes"].values():
        assert [cell["clients"] for cell in cells] == [cell["max_running"] for cell in cells] == clients
        for cell in cells:
            assert cell["completed"] >= 1 and cell["failed"] == 0 and cell["mean_completion_tokens"] == 16
            assert 0 < cell["ttft_p50"] <= cell["ttft_p95"]
    for row in modes["comparison"]:
        assert row["requests_per_second_vs_prefix"] > 0 and row["ttft_p50_vs_full"] > 0
    # a row per recurrent mixer kind, batched against one at a time at its client count
    families = result["throughput"]["families"]["rows"]
    assert [row["model_type"] for row in families] == list(result["config"]["family_kinds"])
    for row in families:
        assert row["mixer"] and row["tiny"] and row["parameters"] > 0
        for way in ("batched", "one_at_a_time"):
            [cell] = row[way]
            assert cell["clients"] == result["config"]["family_clients"] and cell["completed"] >= 1
            assert cell["failed"] == 0
        assert row["comparison"][0]["requests_per_second_ratio"] > 0
    report = (tmp_path / "bench_test.md").read_text()
    assert "batched / one at a time" in report and "| hypic / prefix, req/s |" in report
    assert "| jamba | selective scan (Mamba1) |" in report


def test_bench_sections_are_checked(tmp_path) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "hypic_rag.cli.main", "bench", "--sections", "modes,speed", "--output", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode == 2
    assert "--sections: choose among modes, throughput" in completed.stderr


def test_bench_defaults_to_the_quick_profile_under_the_current_directory() -> None:
    from hypic_rag.cli.main import build_parser

    args = build_parser().parse_args(["bench"])
    assert args.profile is None and not args.quick  # run() maps "no profile" to quick
    assert args.output == "hypic-rag-bench"


def test_the_server_rows_say_how_the_service_ran() -> None:
    """The one-process row and the `--workers N` row of `server_clients` render side by side, each headed by how
    the service ran, with its cells and ratio."""
    from hypic_rag.bench.report import throughput_markdown

    def row(workers: int, concurrent: float) -> dict:
        cell = {"completed": 96, "ttft_p50": 0.05, "latency_p50": 0.07, "mean_completion_tokens": 3.0}
        return {"endpoint": "/v1/ask (streamed, top_k 4)", "corpus": "foreign_corpus", "new_tokens": 16,
                "workers": workers, "one_client": {**cell, "clients": 1, "requests_per_second": 14.0},
                "concurrent": {**cell, "clients": 8, "requests_per_second": concurrent},
                "requests_per_second_ratio": concurrent / 14.0, "answers_compared": 192, "mismatches": 0}

    text = "\n".join(throughput_markdown({"server_clients": row(1, 28.0), "server_clients_workers": row(2, 35.0)}))
    assert "## Through the service (one server process), one client against 8" in text
    assert "## Through the service (`serve --workers 2`), one client against 8" in text
    assert "Requests/s ratio: 2x" in text and "Requests/s ratio: 2.5x" in text
