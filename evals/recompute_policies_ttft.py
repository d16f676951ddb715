"""Time to first token of recompute policies on the benchmark's timing model (issues 20 and 29's TTFT targets).

The random `hypic_rag.bench` timing model (`medium`: 174M parameters, 16 layers) and its rag_qa workload (k chunks
drawn from a pool, a 32-token prefix, a 24-token question, warm cache: every entry a variant reads encoded
beforehand, as precompute would), at the shapes `--shapes` (k x chunk tokens; the issue's 8 x 256 and 16 x 512, and
the test bed's 8 x 34). For each variant: the median TTFT (prefill + choosing the token, probe passes included) over
the requests, its ratio to seam 8's, the same for the process's CPU time (with `--threads 1` what a loaded machine
distorts least), and the tokens recomputed. A variant is a runtime policy spec (`seam@8`,
`budget:2`, `seam@0+anchored`, ...), a mode (`transition_rope`, `full`), or a model-signal rule of
`evals/policy_signals.py` (`attention:N@W`: its probe pass is timed with it; `deviation:N@W`: its per-chunk
statistic is computed beforehand, as ingestion would). The variants are timed side by side in one process (each
round runs every variant on every request, in rotated order), and the JSON also records each shape's entry bytes per
chunk (plain, anchored, chained) and encoding seconds per chunk. Chunks are ranked in prompt order (random requests
have no retrieval); chunk 2m+1 is marked as following chunk 2m (two-chunk documents, read by `+chained` policies).
One run; the machine may be shared (the JSON records the load).

    OMP_WAIT_POLICY=PASSIVE python -m evals.recompute_policies_ttft --shapes 8x256,16x512,8x34 \\
        --out docs/benchmarks/recompute_policies_ttft_worlds.json --markdown docs/benchmarks/recompute_policies_ttft_worlds.md
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DEFAULT_VARIANTS = ("transition_rope,seam@8,budget:2,attention:2@0,deviation:2@0,seam@0+anchored,seam@8+anchored,"
                    "budget:2+anchored,full")
MODES = ("transition_rope", "full")


def prefill_function(engine: Any, variant: str) -> Callable[[Any], tuple[torch.Tensor, int]]:
    """request -> (next-token logits [vocab], tokens recomputed) of `variant` on `engine`."""
    from evals.policy_signals import SIGNAL_RULE, DeviationIndex, prefill_by_attention, prefill_by_deviation

    if variant in MODES:
        def mode(request: Any) -> tuple[torch.Tensor, int]:
            result = engine.prefill(request, variant)
            return result.logits, result.stats.recomputed_tokens
        return mode
    signal = SIGNAL_RULE.fullmatch(variant)
    if signal is not None:
        chunks, seam = int(signal.group("chunks")), int(signal.group("seam"))
        if signal.group("signal") == "attention":
            return lambda request: (lambda out: (out[0], out[2]))(prefill_by_attention(engine, request, chunks, seam))
        deviations = DeviationIndex(engine)
        return lambda request: (lambda out: (out[0], out[2]))(
            prefill_by_deviation(engine, deviations, request, chunks, seam))

    def policy(request: Any) -> tuple[torch.Tensor, int]:
        result = engine.prefill(request, "hypic", policy=variant)
        return result.logits, result.stats.recomputed_tokens
    return policy


def measure(model: Any, top_k: int, chunk_tokens: int, variants: list[str], requests: int, seed: int,
            repeats: int) -> dict[str, Any]:
    """Median TTFT per variant over `requests` rag_qa requests (best of `repeats` each, after an untimed run that
    fills the cache with what the variant reads)."""
    from hypic_rag.bench import workloads as W
    from hypic_rag.runtime.engine import Engine

    tokens = W.TokenSource(model.config.vocab_size, seed)
    workload = W.rag_qa(tokens, top_k=top_k, pool_size=3 * top_k, chunk_tokens=chunk_tokens, requests=requests,
                        warmup=1)
    engine = Engine(model, seam_tokens=8, memory_cache_bytes=16 << 30)
    functions = {variant: prefill_function(engine, variant) for variant in variants}
    for request in workload.warmup + workload.requests:  # documents of two chunks, both retrieved, in order: only
        # chained policies read this (chunk 2m+1 follows chunk 2m)
        request.chunk_follows = [number % 2 == 1 for number in range(len(request.chunk_ids))]

    def once(variant: str, request: Any) -> tuple[float, float, int]:
        began, began_cpu = time.perf_counter(), time.process_time()
        logits, recomputed = functions[variant](request)
        int(torch.argmax(logits))
        return time.perf_counter() - began, time.process_time() - began_cpu, recomputed

    for variant in variants:  # untimed: every entry it reads encoded (precompute), the code paths warm
        for request in workload.warmup + workload.requests:
            once(variant, request)
    # timed side by side: each round runs every variant on every request, the variants' order rotated per round, so
    # a change in the machine's load falls on all of them alike; a request's time is its best round
    times = {variant: [float("inf")] * len(workload.requests) for variant in variants}
    cpu_times = {variant: [float("inf")] * len(workload.requests) for variant in variants}
    recomputed = {variant: [0] * len(workload.requests) for variant in variants}
    for round_number in range(repeats):
        for number, request in enumerate(workload.requests):
            shift = (round_number + number) % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                seconds, cpu_seconds, tokens = once(variant, request)
                times[variant][number] = min(times[variant][number], seconds)
                cpu_times[variant][number] = min(cpu_times[variant][number], cpu_seconds)
                recomputed[variant][number] = tokens
    rows: dict[str, dict[str, Any]] = {
        variant: {"ttft_median_s": statistics.median(times[variant]), "ttft_s": times[variant],
                  "ttft_cpu_median_s": statistics.median(cpu_times[variant]), "ttft_cpu_s": cpu_times[variant],
                  "recomputed_tokens": sum(recomputed[variant]) / len(recomputed[variant])}
        for variant in variants}
    base = rows["seam@8"]["ttft_median_s"] if "seam@8" in rows else float("nan")
    base_cpu = rows["seam@8"]["ttft_cpu_median_s"] if "seam@8" in rows else float("nan")
    for row in rows.values():
        row["x_seam8"] = row["ttft_median_s"] / base
        row["x_seam8_cpu"] = row["ttft_cpu_median_s"] / base_cpu
    prompt = sum(request.prompt_tokens for request in workload.requests) / len(workload.requests)
    return {"chunk_tokens": chunk_tokens, "top_k": top_k, "requests": requests, "prompt_tokens": prompt, "rows": rows,
            "entry_bytes": entry_bytes(engine, workload.requests[0], seam=8)}


def entry_bytes(engine: Any, request: Any, seam: int) -> dict[str, float]:
    """Mean bytes per chunk of `request`'s entries for seam `seam`: the plain entry, what its anchored entry holds
    beyond it (the anchor's K/V rows and token ids), what a chained entry holds beyond it (the anchor's and the
    antecedent chunk's: chunk 2m+1 after chunk 2m), and the seconds to encode each kind of entry per chunk (a
    fresh engine, nothing cached; precompute's cost, never a request's)."""
    from hypic_rag.entry.schema import entry_tensor_bytes
    from hypic_rag.runtime.anchoring import anchor_of, anchored_extra_bytes, anchored_key, chained_anchor
    from hypic_rag.runtime.engine import Engine, PrefillStats

    stats = PrefillStats(mode="hypic")
    chunks = [list(chunk) for chunk in request.chunk_ids]
    anchor = anchor_of(request.prefix_ids)
    keys = {
        "plain": [(seam, tuple(chunk)) for chunk in chunks],
        "anchored": [anchored_key(anchor, chunk, seam) for chunk in chunks],
        "chained": [anchored_key(chained_anchor(anchor, chunks[number - 1]), chunks[number], seam)
                    for number in range(1, len(chunks), 2)],
    }
    fresh = Engine(engine.model, seam_tokens=seam, memory_cache_bytes=16 << 30)
    seconds: dict[str, float] = {}
    entries: dict[str, list[Any]] = {}
    for kind, found in keys.items():
        began = time.perf_counter()
        entries[kind] = [fresh.fetch_entries([list(ids)], entry_seam, stats)[0] for entry_seam, ids in found]
        seconds[kind] = (time.perf_counter() - began) / len(found)
    plain_bytes = sum(entry_tensor_bytes(entry) for entry in entries["plain"]) / len(chunks)
    extra = sum(anchored_extra_bytes(entry, len(anchor)) for entry in entries["anchored"]) / len(chunks)
    chained_extra = sum(anchored_extra_bytes(entry, entry_seam - seam) for entry, (entry_seam, _)
                        in zip(entries["chained"], keys["chained"])) / len(keys["chained"])
    return {"seam": seam, "anchor_tokens": len(anchor), "plain_bytes_per_chunk": plain_bytes,
            "anchored_extra_bytes_per_chunk": extra, "anchored_extra_fraction": extra / plain_bytes,
            "chained_extra_bytes_per_chunk": chained_extra, "chained_extra_fraction": chained_extra / plain_bytes,
            "encode_seconds_per_chunk": seconds}


def markdown(result: dict[str, Any]) -> str:
    lines = [f"Timing model: {result['timing_model']}; {result['machine']}. One run, the variants side by side "
             f"(every round runs each on each request), best of {result['repeats']} rounds per request, median over "
             f"requests; load average {result['load_average_at_start'][0]:.1f} at the start, "
             f"{result['load_average_at_end'][0]:.1f} at the end (a shared machine: noisy).", ""]
    for case in result["cases"]:
        lines += [f"### k = {case['top_k']} x {case['chunk_tokens']}-token chunks, {case['requests']} requests "
                  f"(~{case['prompt_tokens']:.0f} prompt tokens)", "",
                  "| variant | TTFT median (s) | x seam@8 | CPU time median (s) | x seam@8 (CPU) | recomputed tokens |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for name, row in case["rows"].items():
            cpu = (f"{row['ttft_cpu_median_s']:.3f} | {row['x_seam8_cpu']:.2f}" if "ttft_cpu_median_s" in row
                   else " | ")  # reports written before CPU time was measured
            lines.append(f"| {name} | {row['ttft_median_s']:.3f} | {row['x_seam8']:.2f} | {cpu} | "
                         f"{row['recomputed_tokens']:.0f} |")
        sizes = case.get("entry_bytes")
        if sizes:
            lines += ["", f"Entry bytes per chunk (seam {sizes['seam']}): plain {sizes['plain_bytes_per_chunk'] / 2**20:.2f} "
                          f"MiB; anchored +{sizes['anchored_extra_bytes_per_chunk'] / 2**10:.1f} KiB "
                          f"(+{100 * sizes['anchored_extra_fraction']:.1f}%, a {sizes['anchor_tokens']}-token anchor)"
                          + (f"; chained +{sizes['chained_extra_bytes_per_chunk'] / 2**20:.2f} MiB "
                             f"(+{100 * sizes['chained_extra_fraction']:.1f}%, the anchor and the antecedent chunk). "
                             "Encoding per chunk (precompute): " + ", ".join(
                                 f"{kind} {value:.3f} s" for kind, value in sizes["encode_seconds_per_chunk"].items())
                             if "chained_extra_bytes_per_chunk" in sizes else "") + "."]
        lines.append("")
    return "\n".join(lines)


def parse_shape(text: str) -> tuple[int, int]:
    """`KxL` -> (k chunks, L tokens per chunk)."""
    chunks, _, length = text.strip().partition("x")
    return int(chunks), int(length)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timing-model", default="medium")
    parser.add_argument("--shapes", default="8x256,16x512,8x34", help="k x chunk tokens, comma-separated")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--time-limit", type=float, default=1200.0,
                        help="seconds: no further shape is started after this (what was measured is kept)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)

    from hypic_rag.bench.run import machine_description
    from hypic_rag.bench.timing_model import build_timing_model
    from hypic_rag.runtime.model import wrap_model

    hf_model = build_timing_model(args.timing_model, seed=0)
    model = wrap_model(hf_model)
    parameters = sum(p.numel() for p in hf_model.parameters())
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    started = time.perf_counter()
    result: dict[str, Any] = {
        "timing_model": f"random qwen3_5 '{args.timing_model}', {parameters / 1e6:.0f}M parameters",
        "machine": machine_description(), "repeats": args.repeats, "load_average_at_start": os.getloadavg(),
        "cases": [],
    }
    for shape in args.shapes.split(","):
        if time.perf_counter() - started > args.time_limit:
            logging.warning("time limit reached: shape %s and later ones not measured", shape)
            break
        top_k, chunk_tokens = parse_shape(shape)
        result["cases"].append(measure(model, top_k, chunk_tokens, variants, args.requests, 0, args.repeats))
        result["load_average_at_end"] = os.getloadavg()
        result["seconds"] = round(time.perf_counter() - started, 1)
        if args.out:  # after every shape: a long run stopped early keeps what it measured
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown(result) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
