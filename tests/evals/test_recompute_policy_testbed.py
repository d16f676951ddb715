"""The recompute-policy test bed (`evals/recompute_policies.py`): its study-only rules, rankings and report on a tiny
random model and small made-up results (the real evaluation is minutes long and writes docs/benchmarks/)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from evals.recompute_policies import (
    STAGE3_MODEL,
    WideSeams,
    anchored_bytes_per_chunk,
    chunk_ranks,
    entry_bytes_per_token,
    markdown_table,
    pareto_flags,
    paired_difference,
    parse_variant,
    prefill_ends,
    run_variant,
)
from hypic_rag.runtime.engine import Engine, PrefillStats
from hypic_rag.runtime.model import wrap_model
from hypic_rag.runtime.request import Request
from hypic_rag.testing import build_tiny_model


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(wrap_model(build_tiny_model("qwen3_5", seed=9)), seam_tokens=4)


def request_of(seed: int, lengths: list[int]) -> Request:
    generator = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, 256, (n,), generator=generator).tolist()  # noqa: E731
    return Request(ids(5), [ids(n) for n in lengths], ids(6))


def test_the_stage3_checkpoint_is_in_the_repository() -> None:
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in STAGE3_MODEL.iterdir()}


def test_a_chunk_without_its_end_has_the_chunks_first_keys_and_values(engine: Engine) -> None:
    """What `ends:E@W` relies on: attention is causal, so the shorter segment's K/V are the chunk's first ones."""
    chunk = request_of(0, [20]).chunk_ids[0]
    stats = PrefillStats(mode="test")
    whole, head = engine.fetch_entries([chunk, chunk[:14]], 4, stats)
    for name, tensor in head.items():
        if name.endswith((".key", ".value")):
            torch.testing.assert_close(tensor, whole[name][:, :14], atol=1e-5, rtol=1e-5)


def test_ends_recomputes_each_chunks_seam_and_end(engine: Engine) -> None:
    request = request_of(1, [20, 15, 18])
    result = prefill_ends(engine, request, seam=4, end_tokens=6)
    assert result.recomputed_tokens == 3 * (4 + 6) + len(request.question_ids)
    # ends covering all but the seam: every chunk recomputed whole, which is `full` (the prefix is exact)
    covered = prefill_ends(engine, request, seam=4, end_tokens=16)
    torch.testing.assert_close(covered.logits, engine.prefill(request, "full").logits, atol=1e-5, rtol=1e-5)


def test_wide_seams_give_the_top_ranked_chunks_the_wider_seam(engine: Engine) -> None:
    plan = WideSeams(chunks=2, wide_seam=12, seam=4).plan([20, 15, 18, 9], 4, [3, 0, 2, 1])
    assert plan.chunk_seams == (4, 12, 4, 12)
    variant = parse_variant("wide:1:12@4|prompt", 4)
    request = request_of(2, [20, 15, 18])
    _, _, recomputed = run_variant(engine, variant, request)
    assert recomputed == 12 + 4 + 4 + len(request.question_ids)


def test_rankings() -> None:
    case = SimpleNamespace(chunk_token_ids=[[1]] * 5, from_hop=[False, False, False, True, True],
                           scores=[0.9, 0.8, 0.7, 0.2, 0.5], retrieved_doc_ids=["a", "b", "c", "d", "e"],
                           question=SimpleNamespace(gold_doc_ids=("d", "b")))
    assert chunk_ranks("prompt", case) == [0, 1, 2, 3, 4]
    assert chunk_ranks("alternate", case) == [0, 2, 4, 1, 3]
    assert chunk_ranks("score", case) == [0, 1, 2, 4, 3]
    assert chunk_ranks("nearest", case) == [4, 3, 2, 1, 0]
    assert chunk_ranks("oracle", case) == [2, 1, 3, 0, 4]
    with pytest.raises(ValueError):
        chunk_ranks("random", case)


def test_the_pareto_front_and_the_table() -> None:
    rows = {
        "full": {"variant": "full", "recomputed_tokens": 100.0, "exact_match": 0.9, "kl": 0.0},
        "seam@8": {"variant": "seam@8", "recomputed_tokens": 20.0, "exact_match": 0.8, "kl": 0.4},
        "worse": {"variant": "worse", "recomputed_tokens": 30.0, "exact_match": 0.75, "kl": 0.5},
        "whole:1|prompt": {"variant": "whole:1|prompt", "recomputed_tokens": 30.0, "exact_match": 0.9, "kl": 0.1},
    }
    ordered = list(rows.values())
    assert pareto_flags(ordered) == [False, True, False, True]
    for row in ordered:
        row.update(kl_median=row["kl"], agreement=1.0, notes="", **paired_difference([True, False], [True, True]))
    report = {"questions": 2, "seed": 1, "k": 8, "model_label": "m", "prompt_tokens": 100.0, "question_tokens": 10.0,
              "rows": rows}
    table = markdown_table(report)
    lines = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [line.split(" | ")[0][2:] for line in lines] == ["seam@8", "whole:1|prompt", "worse", "full"]
    assert "| 1.50 |" in lines[1]  # 30 tokens / seam@8's 20


def test_paired_difference_counts_discordant_questions() -> None:
    result = paired_difference([True, True, False, False], [True, False, True, False])
    assert result["em_minus_full"] == 0.0
    assert (result["only_variant_right"], result["only_full_right"]) == (1, 1)
    low, high = result["em_minus_full_ci95"]
    assert low < 0 < high


# ------------------------------------------------------------------------------------------------ model signals
def test_the_attention_hook_sees_every_attention_layer_and_changes_nothing(engine: Engine) -> None:
    from evals.policy_signals import QuestionAttention, chunk_spans
    from hypic_rag.runtime.stack import run_batch

    request = request_of(3, [12, 9, 15])
    plan = engine.plan_prefill(request, "hypic")
    [plain] = run_batch(engine.model, [plan.item()])
    observer = QuestionAttention(len(request.question_ids))
    item = plan.item()
    item.observe_attention = observer
    [observed] = run_batch(engine.model, [item])
    plain, observed = plain.logits, observed.logits
    torch.testing.assert_close(observed, plain, atol=0, rtol=0)
    attention_layers = [i for i, block in enumerate(engine.model.blocks) if block.attention is not None]
    assert sorted(observer.mass) == attention_layers
    for mass in observer.mass.values():  # a distribution over the prompt's positions
        assert mass.shape == (request.prompt_tokens,)
        torch.testing.assert_close(mass.sum(), torch.tensor(1.0), atol=1e-5, rtol=0)
    assert chunk_spans(request) == [(5, 17), (17, 26), (26, 41)]


def test_the_attention_rule_recomputes_the_chunks_the_question_reads_and_counts_its_probe(engine: Engine) -> None:
    from evals.policy_signals import prefill_by_attention

    request = request_of(4, [12, 9, 15, 10])
    logits, _, recomputed, chosen = prefill_by_attention(engine, request, 2, 0)
    assert len(chosen) == 2
    question = len(request.question_ids)
    lengths = [len(chunk) for chunk in request.chunk_ids]
    assert recomputed == question + sum(lengths[n] for n in chosen) + question  # the probe, then the final pass
    # every chunk chosen: the final pass is `full`
    logits, _, _, chosen = prefill_by_attention(engine, request, 4, 0)
    assert chosen == {0, 1, 2, 3}
    torch.testing.assert_close(logits, engine.prefill(request, "full").logits, atol=1e-5, rtol=1e-5)


def test_the_deviation_rule_reads_a_per_chunk_statistic(engine: Engine) -> None:
    from evals.policy_signals import DeviationIndex, prefill_by_deviation

    deviations = DeviationIndex(engine)
    request = request_of(5, [12, 9, 15])
    values = [deviations.deviation(request.prefix_ids, chunk) for chunk in request.chunk_ids]
    assert all(value > 0 for value in values)  # anchoring moves every chunk's keys and values
    assert deviations.deviation([], request.chunk_ids[0]) == 0.0  # no anchor: the plain entry itself
    _, _, recomputed, chosen = prefill_by_deviation(engine, deviations, request, 1, 0)
    assert chosen == {max(range(3), key=values.__getitem__)}
    assert recomputed == len(request.chunk_ids[next(iter(chosen))]) + len(request.question_ids)
    variant = parse_variant("deviation:1@0", 4)
    assert variant.kind == "deviation" and variant.extra_bytes_per_chunk == 4
    assert parse_variant("attention:2@8", 4).extra_passes == 1


def test_worlds_are_summarised_per_world_and_on_average(tmp_path) -> None:
    from evals.recompute_policies import plot_worlds, report_markdown, summarize_worlds, worlds_markdown

    def row(label: str, flags: str, tokens: float, kind: str = "policy", **extra) -> dict:
        return {"variant": label, "spec": label, "kind": kind, "notes": "", "exact_match": flags.count("1") / len(flags),
                "exact_flags": flags, "recomputed_tokens": tokens, "kl": 0.1, "kl_median": 0.0, "agreement": 0.9,
                **extra, **paired_difference([f == "1" for f in flags], [True] * len(flags))}

    worlds = []
    for seed, seam_flags in ((1, "1101"), (2, "1111")):
        rows = {"full": row("full", "1111", 100.0, "mode"), "seam@8": row("seam@8", seam_flags, 20.0),
                "seam@0+anchored": row("seam@0+anchored", "1111", 5.0, extra_bytes_per_chunk=2048.0)}
        worlds.append({"seed": seed, "questions": 4, "k": 8, "model_label": "m", "prompt_tokens": 100.0,
                       "question_tokens": 5.0, "rows": rows})
    summary = summarize_worlds(worlds)
    seam = summary["seam@8"]
    assert seam["em_minus_full_by_world"] == [-0.25, 0.0]
    assert seam["em_minus_full_mean"] == -0.125 and seam["em_minus_full_worst"] == -0.25
    assert seam["questions"] == 8 and seam["x_reference"] == 1.0
    assert summary["seam@0+anchored"]["x_reference"] == 0.25
    report = {"questions": 4, "k": 8, "model_label": "m", "worlds": worlds, "summary": summary}
    text = worlds_markdown(report)
    assert "| seam@0+anchored | 5.0 | 0.25 | 100.0% | +0.0" in text and "+2.0 KiB/chunk" in text
    assert "| seam@8 | -25.0 [" in text  # the per-world matrix
    assert "**World 2**" in text
    assert "index bytes / chunk" not in text  # no index measured: no column
    kinds = {kind: {"policy": policy, "chunks": 2, "entries": 3, "bytes_per_chunk": 1024.0 * size,
                    "x_plain": size / 100, "encode_seconds": 1.0}
             for kind, policy, size in (("plain", "seam", 100), ("anchored", "seam+anchored", 103),
                                        ("chained", "seam+chained", 160))}
    measured = report_markdown({**report, "seam_tokens": 8,
                                "index_bytes": {"chunk_tokens": 48, "seam_tokens": 8, "kinds": kinds}})
    assert "| seam@8 | 20.0 |" in measured and "| 100 KiB (1.00x, plain) |" in measured
    assert "| 103 KiB (1.03x, anchored) |" in measured  # seam@0+anchored reads the anchored index
    assert "| full | 100.0 |" in measured and "| anchored | `seam+anchored` | 2 | 3 | 103.0 KiB | 1.03 |" in measured
    plot_worlds(report, tmp_path / "worlds.png")
    assert (tmp_path / "worlds.png").stat().st_size > 1000


def test_a_resumed_run_keeps_the_worlds_and_calibration_it_finds(tmp_path) -> None:
    import json

    from evals.recompute_policies import resumed_report

    header = {"model": "m", "model_label": "m", "questions": 4, "k": 8, "seam_tokens": 8}
    path = tmp_path / "report.json"
    assert resumed_report(path, header) == (None, [])  # nothing to resume
    single = {**header, "seed": 1, "rows": {}, "calibration": {"choices": []}}  # one world: that world's report
    path.write_text(json.dumps(single))
    calibration, worlds = resumed_report(path, header)
    assert calibration == {"choices": []} and [world["seed"] for world in worlds] == [1]
    assert "calibration" not in worlds[0]
    path.write_text(json.dumps({**header, "worlds": [{"seed": 1}, {"seed": 2}], "summary": {}}))
    assert [world["seed"] for world in resumed_report(path, header)[1]] == [1, 2]
    with pytest.raises(ValueError, match="questions"):
        resumed_report(path, {**header, "questions": 400})


def test_a_chained_policy_counts_its_antecedents_rows_as_the_entries_it_reads_hold(engine: Engine) -> None:
    """The bytes per chunk from the keys' lengths equal those of the entries read (encoded, then measured with
    `anchoring.anchored_extra_bytes`), and a chained entry holds its antecedent's rows beyond the anchored one's."""
    from hypic_rag.runtime.anchoring import anchor_of, anchored_extra_bytes
    from hypic_rag.runtime.recompute_policy import as_policy

    generator = torch.Generator().manual_seed(4)
    chunks = [torch.randint(3, 60, (length,), generator=generator).tolist() for length in (9, 12, 7)]
    request = Request([1, 5, 6, 7, 8], chunks, [9, 10, 11], chunk_follows=[False, True, False])
    seam = 2
    anchored = anchored_bytes_per_chunk(engine, request, seam, as_policy(f"seam@{seam}+anchored"))
    chained = anchored_bytes_per_chunk(engine, request, seam, as_policy(f"seam@{seam}+chained"))
    per_token = entry_bytes_per_token(engine)
    anchor = len(anchor_of(request.prefix_ids))
    assert anchored == per_token * anchor
    assert chained == per_token * (3 * anchor + len(chunks[0])) / 3  # chunk 2 was encoded after chunk 1
    keys = engine.segment_entry_keys(request, "hypic", policy=as_policy(f"seam@{seam}+chained"))[1:]
    stats = PrefillStats(mode="hypic")
    measured = [anchored_extra_bytes(engine.fetch_entries([list(ids)], entry_seam, stats)[0], entry_seam - seam)
                for entry_seam, ids in keys]
    assert chained == sum(measured) / len(measured)
