"""Measure one workload under every mode, side by side, on one engine."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from hypic_rag.bench.floor import MachineRates, floor_seconds, prefill_flops
from hypic_rag.bench.workloads import Workload
from hypic_rag.entry.schema import entry_bytes
from hypic_rag.runtime.assembly import Assembly
from hypic_rag.runtime.engine import Engine, PrefillStats
from hypic_rag.runtime.model import HybridModel
from hypic_rag.runtime.modes import MODES, entry_seams
from hypic_rag.runtime.quality import kl_divergence
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.runtime.scheduler import SchedulerConfig
from hypic_rag.pipeline.session import new_scheduler

logger = logging.getLogger(__name__)


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else float("nan")


RunOne = Callable[[int], tuple[float, int]]
"""Sends request number n and waits for its answer: (seconds to its first token, completion tokens)."""


@dataclass(slots=True)
class LoopSamples:
    """What one closed-loop run measured: per completed request its time to first token, latency and completion
    tokens; the failures; the run's wall time."""

    ttfts: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0


def closed_loop(run_one: RunOne, clients: int, max_requests: int, max_seconds: float, first: int = 0) -> LoopSamples:
    """`clients` threads each sending requests (numbers `first`, `first` + 1, ...) one after the other until
    `max_requests` were started or `max_seconds` passed."""
    lock = threading.Lock()
    samples = LoopSamples()
    started = [0]
    began = time.perf_counter()

    def client() -> None:
        while True:
            with lock:
                if started[0] >= max_requests or time.perf_counter() - began > max_seconds:
                    return
                number = first + started[0]
                started[0] += 1
            sent = time.perf_counter()
            try:
                ttft, completion = run_one(number)
            except Exception as error:  # reported in the cell, not raised: a cell measures what completed
                logger.warning("request %d failed: %s", number, error)
                with lock:
                    samples.errors.append(f"{type(error).__name__}: {error}")
                continue
            with lock:
                samples.ttfts.append(ttft)
                samples.latencies.append(time.perf_counter() - sent)
                samples.tokens.append(completion)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=max_seconds + 1200)
    samples.seconds = time.perf_counter() - began
    return samples


def distinct_segments(requests: Sequence[Request]) -> list[list[int]]:
    seen: dict[tuple[int, ...], list[int]] = {}
    for request in requests:
        for segment in request.segments:
            seen.setdefault(tuple(segment), segment)
    return list(seen.values())


def warm_entries(engine: Engine, requests: Sequence[Request], seams: set[int], show_progress: bool) -> None:
    """Offline precompute: every distinct segment encoded once per seam window."""
    segments = distinct_segments(requests)
    batch = 16
    for seam in sorted(seams):
        with tqdm(total=len(segments), desc=f"precompute (seam {seam})", unit="chunk", disable=not show_progress, leave=False) as bar:
            for start in range(0, len(segments), batch):  # batched encoding, as precompute does
                engine.fetch_entries(segments[start : start + batch], seam, PrefillStats(mode="precompute"))
                bar.update(len(segments[start : start + batch]))


def timed_prefill(engine: Engine, request: Request, assembly: Assembly | str) -> tuple[float, torch.Tensor, Any]:
    """Time to first token: the prefill (entry fetch, compose, recompute) plus choosing the token."""
    began = time.perf_counter()
    result = engine.prefill(request, assembly)
    int(torch.argmax(result.logits))
    return time.perf_counter() - began, result.logits, result.stats


TRANSFORMERS = "transformers"
"""The row of transformers' own forward of the same prompt (`model(ids, use_cache=False, logits_to_keep=1)`):
what a user would run instead."""


def timed_transformers_forward(model: HybridModel, request: Request) -> tuple[float, torch.Tensor]:
    """Time to first token of transformers' own forward over the whole prompt (no cache of any kind)."""
    ids = torch.tensor([request.all_ids()], device=model.device)
    began = time.perf_counter()
    with torch.no_grad():  # `hf_model` is the stock model (the runtime's oneDNN linears are on its view)
        logits = model.hf_model(ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()
    int(torch.argmax(logits))
    return time.perf_counter() - began, logits


def recomputed_positions(request: Request, mode: str, seam_tokens: int, prefix_reused: int) -> list[int]:
    """Sequence positions of the tokens `mode` runs through the model for `request` (for the FLOP floor)."""
    total = request.prompt_tokens
    question = list(range(total - len(request.question_ids), total))
    if mode in ("full", TRANSFORMERS):
        return list(range(total))
    if mode == "prefix":
        return list(range(prefix_reused, total))
    if mode != "hypic":
        return question
    positions: list[int] = []
    start = len(request.prefix_ids)
    for chunk in request.chunk_ids:
        if start > 0:  # a chunk at position 0 is exact from its entry
            positions.extend(range(start, start + min(seam_tokens, len(chunk))))
        start += len(chunk)
    return positions + question


def floor_of(model: HybridModel, rates: MachineRates, positions: list[int], loaded_bytes: float) -> float:
    """The floor (seconds) of recomputing the tokens at `positions` (each attending to every earlier key)."""
    attended = float(np.mean([position + 1 for position in positions])) if positions else 0.0
    return floor_seconds(rates, prefill_flops(model.config, len(positions), int(round(attended))), loaded_bytes)


def encoding_throughput(model: HybridModel, segments: Sequence[list[int]], seam_tokens: int) -> dict[str, float]:
    """Tokens/s of encoding `segments` into entries (batched, as precompute and cache misses do) against
    transformers' forward over the same chunks as one batch (which produces no entry at all)."""
    engine = Engine(model, seam_tokens=seam_tokens)
    tokens = sum(len(segment) for segment in segments)
    engine.encode_segments(list(segments[:1]), seam_tokens)  # warm-up
    began = time.perf_counter()
    engine.encode_segments(list(segments), seam_tokens)
    ours = time.perf_counter() - began
    longest = max(len(segment) for segment in segments)
    ids = torch.zeros(len(segments), longest, dtype=torch.long, device=model.device)
    for row, segment in enumerate(segments):
        ids[row, : len(segment)] = torch.tensor(segment)
    with torch.no_grad():
        began = time.perf_counter()
        model.hf_model(ids, use_cache=False, logits_to_keep=1)
        theirs = time.perf_counter() - began
    return {
        "chunks": len(segments),
        "tokens": tokens,
        "encode_tokens_per_second": tokens / ours,
        "transformers_forward_tokens_per_second": tokens / theirs,
        "ratio_vs_transformers": theirs / ours,
    }


def closed_loop_throughput(
    engine: Engine, requests: Sequence[Request], assembly: Assembly, clients: int, max_requests: int,
    max_seconds: float, new_tokens: int,
) -> dict[str, float]:
    """N client threads share one model worker (a scheduler running one sequence at a time): requests/s and
    latency, bounded in count and time (`closed_loop`)."""
    params = SamplingParams(max_new_tokens=new_tokens)
    scheduler = new_scheduler(engine, SchedulerConfig(max_running=1, max_waiting=None)).start()

    def run_one(number: int) -> tuple[float, int]:
        generation = scheduler.generate(requests[number % len(requests)], assembly, params)
        return generation.time_to_first_token, len(generation.token_ids)

    try:
        samples = closed_loop(run_one, clients, max_requests, max_seconds)
    finally:
        scheduler.stop()
    return {
        "clients": clients,
        "completed": len(samples.latencies),
        "seconds": samples.seconds,
        "requests_per_second": len(samples.latencies) / samples.seconds if samples.seconds > 0 else 0.0,
        "latency_p50": percentile(samples.latencies, 50),
        "latency_p95": percentile(samples.latencies, 95),
    }


def measure_workload(
    model: HybridModel, workload: Workload, *, seam_tokens: int, modes: Sequence[str] = MODES, clients: int = 4,
    throughput_requests: int = 8, throughput_seconds: float = 60.0, new_tokens: int = 4, show_progress: bool = True,
    rates: MachineRates | None = None, encode_chunks: int = 0,
) -> dict[str, Any]:
    """Every mode on the same requests, and transformers' own forward of each prompt: TTFT p50/p95, ratios
    against transformers, full and prefix, throughput, recomputed fraction, bytes loaded, KL vs full, and (with
    `rates`) each mode's floor and its distance from it; with `encode_chunks`, encoding throughput."""
    engine = Engine(model, seam_tokens=seam_tokens)
    if not workload.cold:
        seams = entry_seams(modes, seam_tokens)
        warm_entries(engine, [*workload.requests, *workload.warmup, *workload.load], seams, show_progress)
        for request in workload.warmup:  # prefix mode's chunk-boundary checkpoints, from other requests
            engine.prefill(request, "prefix")
    ordered = ["full"] + [mode for mode in modes if mode != "full"] + [TRANSFORMERS]
    samples: dict[str, dict[str, list[float]]] = {
        mode: {key: [] for key in ("ttfts", "fractions", "loaded", "kls", "agree", "floors")} for mode in ordered
    }
    # requests outer, modes inner: every mode of a request runs back to back, so a machine whose speed drifts
    # (shared cores) weighs on every mode alike and the ratios stay fair
    for request in tqdm(workload.requests, desc=f"{workload.name} (all modes)", unit="req", disable=not show_progress, leave=False):
        reference: torch.Tensor | None = None
        for mode in ordered:
            if mode == TRANSFORMERS:
                seconds, logits = timed_transformers_forward(model, request)
                recomputed, loaded_bytes, prefix_reused = request.prompt_tokens, 0, 0
            else:
                run_engine = Engine(model, seam_tokens=seam_tokens) if workload.cold else engine
                seconds, logits, stats = timed_prefill(run_engine, request, Assembly(mode, seam_tokens))
                recomputed, loaded_bytes = stats.recomputed_tokens, stats.cache_bytes_loaded
                prefix_reused = stats.prefix_reused_tokens
            if reference is None:
                reference = logits
            row = samples[mode]
            row["ttfts"].append(seconds)
            row["fractions"].append(recomputed / request.prompt_tokens)
            row["loaded"].append(loaded_bytes)
            if rates is not None:
                positions = recomputed_positions(request, mode, seam_tokens, prefix_reused)
                row["floors"].append(floor_of(model, rates, positions, loaded_bytes))
            row["kls"].append(kl_divergence(reference, logits))
            row["agree"].append(float(torch.argmax(logits) == torch.argmax(reference)))
    per_mode: dict[str, dict[str, Any]] = {}
    for mode in ordered:
        row = samples[mode]
        ttfts, floors = row["ttfts"], row["floors"]
        throughput = (
            closed_loop_throughput(engine, workload.load, Assembly(mode, seam_tokens), clients, throughput_requests,
                                   throughput_seconds, new_tokens)
            if throughput_requests > 0 and workload.load and mode != TRANSFORMERS
            else None
        )
        per_mode[mode] = {
            "ttft_p50": percentile(ttfts, 50),
            "ttft_p95": percentile(ttfts, 95),
            "ttft_seconds": ttfts,
            "recomputed_fraction": float(np.mean(row["fractions"])),
            "cache_bytes_loaded_per_request": float(np.mean(row["loaded"])),
            "kl_vs_full": float(np.mean(row["kls"])),
            "greedy_agreement_vs_full": float(np.mean(row["agree"])),
            "throughput": throughput,
        }
        if floors:
            per_mode[mode]["floor_seconds_p50"] = percentile(floors, 50)
            per_mode[mode]["times_floor"] = percentile(ttfts, 50) / percentile(floors, 50)
    for mode, row in per_mode.items():
        row["ttft_speedup_vs_transformers"] = per_mode[TRANSFORMERS]["ttft_p50"] / row["ttft_p50"]
        row["ttft_speedup_vs_full"] = per_mode["full"]["ttft_p50"] / row["ttft_p50"]
        if "prefix" in per_mode:
            row["ttft_speedup_vs_prefix"] = per_mode["prefix"]["ttft_p50"] / row["ttft_p50"]
    result: dict[str, Any] = {
        "workload": workload.name,
        "requests": len(workload.requests),
        "mean_prompt_tokens": float(np.mean([r.prompt_tokens for r in workload.requests])),
        "modes": per_mode,
    }
    if encode_chunks and workload.pool:
        result["encoding"] = encoding_throughput(model, workload.pool[:encode_chunks], seam_tokens)
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
            seconds, logits, stats = timed_prefill(engine, request, Assembly("hypic", seam))
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
