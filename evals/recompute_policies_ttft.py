"""Time to first token of recompute policies on the benchmark's timing model (issue 20's TTFT target).

The random `hypic_rag.bench` timing model (`medium`: 174M parameters, 16 layers) and its rag_qa workload (k chunks
drawn from a pool, warm cache: every entry encoded beforehand), at the benchmark's chunk size (256 tokens) and at
the test bed's (~34 tokens). For each policy: the median TTFT (prefill + choosing the token) over the requests,
its ratio to seam 8's, and the tokens recomputed. Chunks are ranked in prompt order (random requests have no
retrieval). One run; the machine may be shared (the JSON records it).

    OMP_WAIT_POLICY=PASSIVE python -m evals.recompute_policies_ttft --out docs/benchmarks/recompute_policies_ttft.json \\
        --markdown docs/benchmarks/recompute_policies_ttft.md
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

DEFAULT_POLICIES = "seam@8,whole:1,whole:2,budget:1.5,budget:2,budget:3"


def measure(model: Any, chunk_tokens: int, policies: list[str], requests: int, top_k: int, seed: int,
            repeats: int) -> dict[str, Any]:
    """Median TTFT per policy (and per mode `transition_rope`, `full`) over `requests` rag_qa requests."""
    from hypic_rag.bench import workloads as W
    from hypic_rag.bench.measure import warm_entries
    from hypic_rag.runtime.engine import Engine

    tokens = W.TokenSource(model.config.vocab_size, seed)
    workload = W.rag_qa(tokens, top_k=top_k, pool_size=3 * top_k, chunk_tokens=chunk_tokens, requests=requests,
                        warmup=1)
    engine = Engine(model, seam_tokens=8, memory_cache_bytes=8 << 30)
    warm_entries(engine, workload.requests + workload.warmup, {0, 8}, show_progress=False)
    variants = [("mode", "transition_rope"), *[("policy", p) for p in policies], ("mode", "full")]

    def once(kind: str, name: str, request: Any) -> tuple[float, int]:
        began = time.perf_counter()
        result = (engine.prefill(request, name) if kind == "mode" else engine.prefill(request, "hypic", policy=name))
        int(torch.argmax(result.logits))
        return time.perf_counter() - began, result.stats.recomputed_tokens

    for kind, name in variants:  # warm-up: one request per variant
        once(kind, name, workload.warmup[0])
    rows: dict[str, dict[str, Any]] = {}
    for kind, name in variants:
        times, recomputed = [], []
        for request in workload.requests:
            best = min(once(kind, name, request) for _ in range(repeats))
            times.append(best[0])
            recomputed.append(best[1])
        rows[name] = {"ttft_median_s": statistics.median(times), "ttft_s": times,
                      "recomputed_tokens": sum(recomputed) / len(recomputed)}
    base = rows["seam@8"]["ttft_median_s"]
    for row in rows.values():
        row["x_seam8"] = row["ttft_median_s"] / base
    prompt = sum(request.prompt_tokens for request in workload.requests) / len(workload.requests)
    return {"chunk_tokens": chunk_tokens, "top_k": top_k, "requests": requests, "prompt_tokens": prompt, "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    lines = [f"Timing model: {result['timing_model']}; {result['machine']}. One run, best of {result['repeats']} per "
             "request, median over requests; the machine was shared with other jobs (noisy).", ""]
    for case in result["cases"]:
        lines += [f"### {case['chunk_tokens']}-token chunks, k = {case['top_k']}, {case['requests']} requests "
                  f"(~{case['prompt_tokens']:.0f} prompt tokens)", "",
                  "| variant | TTFT median (s) | x seam@8 | recomputed tokens |", "| --- | --- | --- | --- |"]
        for name, row in case["rows"].items():
            lines.append(f"| {name} | {row['ttft_median_s']:.3f} | {row['x_seam8']:.2f} | {row['recomputed_tokens']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timing-model", default="medium")
    parser.add_argument("--chunk-tokens", default="256,34")
    parser.add_argument("--policies", default=DEFAULT_POLICIES)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
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
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    started = time.perf_counter()
    result = {
        "timing_model": f"random qwen3_5 '{args.timing_model}', {parameters / 1e6:.0f}M parameters",
        "machine": machine_description(), "repeats": args.repeats,
        "load_average_at_start": os.getloadavg(),
        "cases": [measure(model, int(size), policies, args.requests, args.top_k, 0, args.repeats)
                  for size in args.chunk_tokens.split(",")],
    }
    result["load_average_at_end"] = os.getloadavg()
    result["seconds"] = round(time.perf_counter() - started, 1)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown(result) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
