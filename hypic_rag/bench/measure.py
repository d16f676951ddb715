"""Measure one workload under every mode, side by side, on one engine."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from hypic_rag.bench.workloads import Workload
from hypic_rag.entry import entry_bytes
from hypic_rag.runtime.engine import Engine, PrefillStats
from hypic_rag.runtime.model import HybridModel
from hypic_rag.runtime.modes import MODES, entry_seams
from hypic_rag.runtime.quality import kl_divergence
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams

logger = logging.getLogger(__name__)


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else float("nan")


def distinct_segments(requests: Sequence[Request]) -> list[list[int]]:
    seen: dict[tuple[int, ...], list[int]] = {}
    for request in requests:
        for segment in request.segments:
            seen.setdefault(tuple(segment), segment)
    return list(seen.values())


def warm_entries(engine: Engine, requests: Sequence[Request], seams: set[int], show_progress: bool) -> None:
    """Offline precompute: every distinct segment encoded once per seam window."""
    segments = distinct_segments(requests)
    for seam in sorted(seams):
        for segment in tqdm(segments, desc=f"precompute (seam {seam})", unit="chunk", disable=not show_progress, leave=False):
            engine.fetch_entries([segment], seam, PrefillStats(mode="precompute"))


def timed_prefill(engine: Engine, request: Request, mode: str, seam_tokens: int) -> tuple[float, torch.Tensor, Any]:
    """Time to first token: the prefill (entry fetch, compose, recompute) plus choosing the token."""
    began = time.perf_counter()
    result = engine.prefill(request, mode, seam_tokens)
    int(torch.argmax(result.logits))
    return time.perf_counter() - began, result.logits, result.stats


def closed_loop_throughput(
    engine: Engine, requests: Sequence[Request], mode: str, seam_tokens: int, clients: int, max_requests: int,
    max_seconds: float, new_tokens: int,
) -> dict[str, float]:
    """N client threads share one model worker (a lock): requests/s and latency, bounded in count and time."""
    lock = threading.Lock()
    latencies: list[float] = []
    next_index = [0]
    began = time.perf_counter()
    params = SamplingParams(max_new_tokens=new_tokens)

    def client() -> None:
        while True:
            with lock:
                if next_index[0] >= max_requests or time.perf_counter() - began > max_seconds:
                    return
                request = requests[next_index[0] % len(requests)]
                next_index[0] += 1
            sent = time.perf_counter()
            with lock:  # the single model worker
                engine.generate(request, mode, params, seam_tokens)
            latencies.append(time.perf_counter() - sent)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=max_seconds + 600)
    elapsed = time.perf_counter() - began
    return {
        "clients": clients,
        "completed": len(latencies),
        "seconds": elapsed,
        "requests_per_second": len(latencies) / elapsed if elapsed > 0 else 0.0,
        "latency_p50": percentile(latencies, 50),
        "latency_p95": percentile(latencies, 95),
    }


def measure_workload(
    model: HybridModel,
    workload: Workload,
    *,
    seam_tokens: int,
    modes: Sequence[str] = MODES,
    clients: int = 4,
    throughput_requests: int = 8,
    throughput_seconds: float = 60.0,
    new_tokens: int = 4,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Every mode on the same requests: TTFT p50/p95, throughput, recomputed fraction, bytes loaded, KL vs full."""
    engine = Engine(model, seam_tokens=seam_tokens)
    if not workload.cold:
        seams = entry_seams(modes, seam_tokens)
        warm_entries(engine, [*workload.requests, *workload.warmup, *workload.load], seams, show_progress)
        for request in workload.warmup:  # prefix mode's chunk-boundary checkpoints, from other requests
            engine.prefill(request, "prefix")
    reference: list[torch.Tensor] = []
    per_mode: dict[str, dict[str, Any]] = {}
    ordered = ["full"] + [mode for mode in modes if mode != "full"]
    for mode in ordered:
        ttfts, fractions, loaded, kls, agree = [], [], [], [], []
        for number, request in enumerate(tqdm(workload.requests, desc=f"{workload.name} {mode}", unit="req", disable=not show_progress, leave=False)):
            run_engine = Engine(model, seam_tokens=seam_tokens) if workload.cold else engine
            seconds, logits, stats = timed_prefill(run_engine, request, mode, seam_tokens)
            ttfts.append(seconds)
            fractions.append(stats.recomputed_tokens / stats.prompt_tokens)
            loaded.append(stats.cache_bytes_loaded)
            if mode == "full":
                reference.append(logits)
            kls.append(kl_divergence(reference[number], logits))
            agree.append(float(torch.argmax(logits) == torch.argmax(reference[number])))
        throughput = (
            closed_loop_throughput(engine, workload.load, mode, seam_tokens, clients, throughput_requests, throughput_seconds, new_tokens)
            if throughput_requests > 0 and workload.load
            else None
        )
        per_mode[mode] = {
            "ttft_p50": percentile(ttfts, 50),
            "ttft_p95": percentile(ttfts, 95),
            "ttft_seconds": ttfts,
            "recomputed_fraction": float(np.mean(fractions)),
            "cache_bytes_loaded_per_request": float(np.mean(loaded)),
            "kl_vs_full": float(np.mean(kls)),
            "greedy_agreement_vs_full": float(np.mean(agree)),
            "throughput": throughput,
        }
    for mode, row in per_mode.items():
        row["ttft_speedup_vs_full"] = per_mode["full"]["ttft_p50"] / row["ttft_p50"]
        if "prefix" in per_mode:
            row["ttft_speedup_vs_prefix"] = per_mode["prefix"]["ttft_p50"] / row["ttft_p50"]
    result: dict[str, Any] = {
        "workload": workload.name,
        "requests": len(workload.requests),
        "mean_prompt_tokens": float(np.mean([r.prompt_tokens for r in workload.requests])),
        "modes": per_mode,
    }
    if workload.pool:
        sample = engine.encode_segment(workload.pool[0], seam_tokens)
        sizes = entry_bytes(sample)
        linear, key_value = sizes.linear_bytes, sizes.kv_bytes
        result["cache_bytes_per_chunk"] = {
            "chunk_tokens": len(workload.pool[0]),
            "linear_state": linear,
            "key_value": key_value,
            "total": linear + key_value,
        }
    return result


def seam_sweep(
    model: HybridModel, workload: Workload, seams: Sequence[int], show_progress: bool = True
) -> list[dict[str, float]]:
    """hypic at each seam window: TTFT p50 and deviation from full on the same requests."""
    engine = Engine(model)
    warm_entries(engine, workload.requests, set(seams), show_progress)
    reference = [engine.prefill(request, "full").logits for request in workload.requests]
    rows = []
    for seam in seams:
        ttfts, kls, agree, fractions = [], [], [], []
        for request, expected in zip(workload.requests, reference):
            seconds, logits, stats = timed_prefill(engine, request, "hypic", seam)
            ttfts.append(seconds)
            kls.append(kl_divergence(expected, logits))
            agree.append(float(torch.argmax(logits) == torch.argmax(expected)))
            fractions.append(stats.recomputed_tokens / stats.prompt_tokens)
        rows.append({
            "seam_tokens": seam,
            "ttft_p50": percentile(ttfts, 50),
            "kl_vs_full": float(np.mean(kls)),
            "greedy_agreement_vs_full": float(np.mean(agree)),
            "recomputed_fraction": float(np.mean(fractions)),
        })
    return rows
