"""Time to first token per family: transformers' own forward against `full` and `hypic` on one random model.

Per family (`family_models`): the same prompts for all three, a prefix, k chunks of `chunk_tokens` tokens from a
pool of k (each request a new order of the same chunks and a new question) and a question; the cache warm (every
chunk's `hypic` entry encoded before timing, so no timed request encodes anything: checked). The three run
interleaved per request (transformers, full, hypic), after one untimed short request through each path; medians
over `runs` requests. Also recorded: max |logit difference| between `full` and transformers (the same computation)
and KL(full || hypic) with greedy agreement (what hypic's speed costs on a random model).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from hypic_rag.bench import workloads as W
from hypic_rag.bench.family_models import build_family_timing_model
from hypic_rag.bench.measure import timed_prefill, timed_transformers_forward, warm_entries
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.model import wrap_model
from hypic_rag.runtime.modes import entry_seams
from hypic_rag.runtime.quality import kl_divergence
from hypic_rag.runtime.request import Request

logger = logging.getLogger(__name__)

PATHS = ("transformers", "full", "hypic")


@dataclass(frozen=True, slots=True)
class FamilyTimingConfig:
    """chunk_tokens x top_k chunks per prompt (plus a 32-token prefix and a 24-token question); `runs` timed
    requests per path (medians); `threads` torch threads; `tiny`: the test suite's tiny models instead of the
    ~100-200M timing models (seconds, for tests)."""

    chunk_tokens: int = 256
    top_k: int = 8
    runs: int = 3
    seam_tokens: int = 8
    threads: int = 2
    tiny: bool = False

    def __post_init__(self) -> None:
        if min(self.chunk_tokens, self.top_k, self.runs, self.threads) < 1 or self.seam_tokens < 0:
            raise ValueError("chunk_tokens, top_k, runs and threads must be >= 1 and seam_tokens >= 0")


def _short_request(request: Request) -> Request:
    """A small request of the same shape (warms each path's first call up)."""
    return Request(request.prefix_ids, [chunk[:16] for chunk in request.chunk_ids[:2]], request.question_ids)


def time_family(model_type: str, config: FamilyTimingConfig, seed: int = 0) -> dict[str, Any]:
    """One family's row: its timing model, TTFT medians and seconds of each path, ratios, deviation."""
    began = time.perf_counter()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        hf_model = build_family_timing_model(model_type, seed=seed, tiny=config.tiny)
        model = wrap_model(hf_model)
        parameters = sum(parameter.numel() for parameter in hf_model.parameters())
        tokens = W.TokenSource(hf_model.config.vocab_size, seed)
        workload = W.rag_qa(tokens, top_k=config.top_k, pool_size=config.top_k, chunk_tokens=config.chunk_tokens,
                            requests=config.runs, warmup=0)
        engine = Engine(model, seam_tokens=config.seam_tokens)
        encode_began = time.perf_counter()
        warm_entries(engine, workload.requests, entry_seams(("hypic",), config.seam_tokens), show_progress=False)
        encode_seconds = time.perf_counter() - encode_began
        warm_up = _short_request(workload.requests[0])
        timed_transformers_forward(model, warm_up)
        timed_prefill(engine, warm_up, "full")
        timed_prefill(engine, warm_up, "hypic")
        seconds: dict[str, list[float]] = {path: [] for path in PATHS}
        logit_gap, kls, agreement, misses = [], [], [], 0
        for request in workload.requests:
            spent, theirs = timed_transformers_forward(model, request)
            seconds["transformers"].append(spent)
            spent, full, _ = timed_prefill(engine, request, "full")
            seconds["full"].append(spent)
            spent, hypic, stats = timed_prefill(engine, request, "hypic")
            seconds["hypic"].append(spent)
            misses += stats.cache_misses
            logit_gap.append(float((full - theirs.to(full.dtype)).abs().max()))
            kls.append(kl_divergence(full, hypic))
            agreement.append(float(torch.argmax(full) == torch.argmax(hypic)))
        if misses:
            raise AssertionError(f"{model_type}: {misses} cache misses in timed hypic requests (the cache was warm)")
        medians = {path: statistics.median(values) for path, values in seconds.items()}
        request = workload.requests[0]
        row = {
            "model_type": model_type,
            "parameters": parameters,
            "layers": len(model.blocks),
            "layer_kinds": {kind: model.layer_types.count(kind) for kind in dict.fromkeys(model.layer_types)},
            "hidden_size": hf_model.config.hidden_size,
            "prompt_tokens": request.prompt_tokens,
            "recomputed_tokens_hypic": stats.recomputed_tokens,
            "ttft_median": medians,
            "ttft_seconds": seconds,
            "full_over_transformers": medians["full"] / medians["transformers"],
            "hypic_speedup_vs_transformers": medians["transformers"] / medians["hypic"],
            "hypic_speedup_vs_full": medians["full"] / medians["hypic"],
            "max_abs_logit_diff_full_vs_transformers": max(logit_gap),
            "kl_full_hypic": statistics.mean(kls),
            "greedy_agreement_full_hypic": statistics.mean(agreement),
            "encode_seconds": encode_seconds,
        }
    finally:
        torch.set_num_threads(previous_threads)
    row["seconds"] = time.perf_counter() - began
    logger.info("%s: transformers %.2f s, full %.2f s, hypic %.3f s (%.0f s in all)", model_type,
                medians["transformers"], medians["full"], medians["hypic"], row["seconds"])
    return row
