"""The whole benchmark: workloads 1-4 on a random timing model and the seam sweep.

Answer quality of the bundled default model is measured by the repository's `evals/eval_default_model.py` (it needs
the synthetic-data generator, which is not installed with the package); its results are in docs/benchmarks/."""

from __future__ import annotations

import logging
import os
import platform
import time
from dataclasses import dataclass
from typing import Any

import torch

from hypic_rag.bench import workloads as W
from hypic_rag.bench.batching import (
    FAMILY_KINDS,
    THROUGHPUT_MODES,
    ThroughputConfig,
    engine_throughput,
    family_throughput,
    modes_throughput,
    server_throughput,
)
from hypic_rag.bench.floor import measure_rates
from hypic_rag.bench.server_clients import server_clients
from hypic_rag.bench.measure import measure_workload, seam_sweep
from hypic_rag.bench.timing_model import TIMING_MODELS, build_timing_model
from hypic_rag.runtime.model import wrap_model

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Sizes of one benchmark profile (`quick` fits in minutes on 2 CPU cores)."""

    profile: str
    timing_model: str
    seam_tokens: int
    chunk_tokens: int
    pool_size: int
    top_ks: tuple[int, ...]
    requests: int
    warmup: int
    long_chunks: int
    long_chunk_tokens: int
    long_requests: int
    agentic_turns: int
    cold_requests: int
    sweep_seams: tuple[int, ...]
    sweep_requests: int
    clients: int
    throughput_requests: int
    throughput_seconds: float
    workloads: tuple[str, ...] = ("rag_qa", "long_context", "agentic", "cold")
    batching_clients: tuple[int, ...] = (1, 4, 8, 16)
    batching_requests: int = 48
    batching_seconds: float = 120.0
    batching_server: bool = True
    server_clients: int = 8
    """The concurrent clients `server_clients` sets against one (with `batching_server`)."""
    server_workers: int = 2
    """Above 1: the `server_clients` row again with `serve --workers N` (`server_clients_workers`)."""
    throughput_modes: tuple[str, ...] = THROUGHPUT_MODES
    family_kinds: tuple[str, ...] = tuple(FAMILY_KINDS)
    family_clients: int = 8
    family_requests: int = 24
    family_seconds: float = 120.0
    family_tiny: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.workloads) - {"rag_qa", "long_context", "agentic", "cold"}
        if unknown:
            raise ValueError(f"unknown workloads {sorted(unknown)}")
        if self.timing_model not in TIMING_MODELS:
            raise ValueError(f"unknown timing model {self.timing_model!r}")
        if self.requests < 1 or self.pool_size < max(self.top_ks):
            raise ValueError("need at least one request and a pool at least as large as the largest k")
        if self.pool_size < 8:
            raise ValueError("the throughput section draws k = 8 chunks: the pool needs at least 8")
        if self.server_workers < 1:
            raise ValueError(f"server_workers must be at least 1, got {self.server_workers}")
        if self.server_clients < 2:
            raise ValueError(f"server_clients must be at least 2 (set against one client), got {self.server_clients}")
        unknown_families = set(self.family_kinds) - set(FAMILY_KINDS)
        if unknown_families:
            raise ValueError(f"no throughput row for families {sorted(unknown_families)}")
        if self.family_clients < 1 or self.family_requests < 1 or self.family_seconds <= 0:
            raise ValueError("family_clients, family_requests and family_seconds must be positive")


PROFILES: dict[str, BenchConfig] = {
    "quick": BenchConfig(
        profile="quick", timing_model="small", seam_tokens=8, chunk_tokens=128, pool_size=24, top_ks=(4, 8),
        requests=5, warmup=4, long_chunks=12, long_chunk_tokens=128, long_requests=2, agentic_turns=4,
        cold_requests=2, sweep_seams=(0, 2, 4, 8, 16, 32), sweep_requests=3, clients=2, throughput_requests=4,
        throughput_seconds=15.0, batching_requests=24, batching_seconds=30.0, family_tiny=True, family_requests=16,
        family_seconds=30.0,
    ),
    # the timing model at realistic chunk sizes: workload 1 at k = 8 x 256, the long-context workload (k = 16 x
    # 512, where full's cost grows with the prompt and hypic's with the chunk count) and cold requests: ~30 min on
    # 2 CPU cores
    "standard": BenchConfig(
        profile="standard", timing_model="medium", seam_tokens=8, chunk_tokens=256, pool_size=24, top_ks=(8,),
        requests=4, warmup=4, long_chunks=16, long_chunk_tokens=512, long_requests=2, agentic_turns=4,
        cold_requests=1, sweep_seams=(0, 2, 8, 32), sweep_requests=2, clients=2, throughput_requests=4,
        throughput_seconds=300.0, workloads=("rag_qa", "long_context", "cold"),
    ),
    # what the test suite runs end to end: seconds, shape and sanity only
    "test": BenchConfig(
        profile="test", timing_model="tiny", seam_tokens=4, chunk_tokens=24, pool_size=8, top_ks=(4,),
        requests=2, warmup=2, long_chunks=4, long_chunk_tokens=24, long_requests=1, agentic_turns=2,
        cold_requests=1, sweep_seams=(0, 4), sweep_requests=1, clients=2, throughput_requests=2,
        throughput_seconds=10.0, batching_clients=(1, 3), batching_requests=6, batching_seconds=30.0,
        batching_server=False, family_tiny=True, family_clients=3, family_requests=6, family_seconds=30.0,
        family_kinds=("qwen3_5", "jamba", "lfm2"),
    ),
    "full": BenchConfig(
        profile="full", timing_model="medium", seam_tokens=8, chunk_tokens=256, pool_size=48, top_ks=(4, 8, 16),
        requests=8, warmup=8, long_chunks=32, long_chunk_tokens=512, long_requests=2, agentic_turns=6,
        cold_requests=3, sweep_seams=(0, 2, 4, 8, 16, 32), sweep_requests=6, clients=4, throughput_requests=8,
        throughput_seconds=120.0,
    ),
}


def machine_description() -> str:
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU only"
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} with {torch.get_num_threads()} threads, "
        f"{device}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}"
    )


SECTIONS = ("modes", "throughput")
"""What a run measures: the modes side by side (workloads, seam sweep) and continuous batching's throughput."""


def run_benchmark(
    config: BenchConfig, *, command: str, show_progress: bool = True, seed: int = 0, sections: tuple[str, ...] = SECTIONS
) -> dict[str, Any]:
    """Run the `sections` of `config` and return the result dict (see report.py for its layout)."""
    unknown = set(sections) - set(SECTIONS)
    if unknown or not sections:
        raise ValueError(f"sections must be among {', '.join(SECTIONS)}, got {sorted(sections)}")
    began = time.time()
    rates = measure_rates()  # the machine's floor rates, first, on this run's threads
    hf_model = build_timing_model(config.timing_model, seed=seed)
    model = wrap_model(hf_model)
    parameters = sum(p.numel() for p in hf_model.parameters())
    tokens = W.TokenSource(hf_model.config.vocab_size, seed)
    workloads: list[W.Workload] = []
    if "rag_qa" in config.workloads and "modes" in sections:
        workloads += [
            W.rag_qa(tokens, top_k=k, pool_size=config.pool_size, chunk_tokens=config.chunk_tokens, requests=config.requests, warmup=config.warmup)
            for k in config.top_ks
        ]
    if "long_context" in config.workloads and "modes" in sections:
        workloads.append(W.long_context(tokens, chunks=config.long_chunks, chunk_tokens=config.long_chunk_tokens, requests=config.long_requests))
    if "agentic" in config.workloads and "modes" in sections:
        workloads.append(W.agentic(tokens, turns=config.agentic_turns, documents=12, document_tokens=config.chunk_tokens, tool_tokens=config.chunk_tokens // 2, per_turn=4))
    if "cold" in config.workloads and "modes" in sections:
        workloads.append(W.cold(tokens, top_k=8, chunk_tokens=config.chunk_tokens, requests=config.cold_requests))
    results = []
    for workload in workloads:
        logger.info("workload %s", workload.name)
        results.append(
            measure_workload(
                model, workload, seam_tokens=config.seam_tokens, clients=config.clients,
                throughput_requests=config.throughput_requests, throughput_seconds=config.throughput_seconds,
                show_progress=show_progress, rates=rates,
                encode_chunks=8 if workload is workloads[0] else 0,
            )
        )
    sweep: list[dict[str, float]] = []
    if "modes" in sections and config.sweep_seams:
        sweep_workload = W.rag_qa(tokens, top_k=8, pool_size=config.pool_size, chunk_tokens=config.chunk_tokens,
                                  requests=config.sweep_requests, warmup=0)
        sweep = seam_sweep(model, sweep_workload, config.sweep_seams, show_progress)
    throughput: dict[str, Any] = {}
    if "throughput" in sections:
        throughput = run_throughput(config, model, tokens, show_progress)
    result: dict[str, Any] = {
        "benchmark": "hypic-rag",
        "command": command,
        "machine": machine_description(),
        "machine_rates": rates.as_dict(),
        "config": {name: getattr(config, name) for name in config.__slots__},
        "timing_model": {
            "name": config.timing_model,
            "parameters": parameters,
            "description": f"random qwen3_5 '{config.timing_model}', {parameters / 1e6:.0f}M parameters, "
            f"{hf_model.config.num_hidden_layers} layers ({hf_model.config.layer_types.count('linear_attention')} Gated DeltaNet, "
            f"{hf_model.config.layer_types.count('full_attention')} attention)",
        },
        "workloads": results,
        "seam_sweep": sweep,
        "throughput": throughput,
        "sections": list(sections),
        "file_suffix": "" if set(sections) == set(SECTIONS) else "_" + "_".join(sections),
    }
    result["seconds"] = time.time() - began
    return result


def run_throughput(config: BenchConfig, model: Any, tokens: W.TokenSource, show_progress: bool) -> dict[str, Any]:
    """Continuous batching against one request at a time, closed loop (`bench/batching.py`): RAG k = 8 on the
    timing model, 16-token answers; `hypic`, `prefix` and `full` under the same load; a row per recurrent mixer kind
    on its family's timing model; and, unless the profile turns it off, the real server with the bundled model (max
    running 16 against 1; and one server's one client against `server_clients` concurrent clients on a corpus the
    model never saw, every concurrent answer compared with the same question asked alone: `server_clients`)."""
    settings = ThroughputConfig(clients=config.batching_clients, max_requests=config.batching_requests,
                                max_seconds=config.batching_seconds)
    workload = W.rag_qa(tokens, top_k=8, pool_size=config.pool_size, chunk_tokens=config.chunk_tokens,
                        requests=max(32, config.batching_requests), warmup=config.warmup)
    logger.info("throughput: engine, %s clients", settings.clients)
    section: dict[str, Any] = {
        "engine": engine_throughput(model, workload.requests, settings, seam_tokens=config.seam_tokens,
                                    show_progress=show_progress),
    }
    if config.throughput_modes:
        logger.info("throughput: modes %s, %s clients", config.throughput_modes, settings.clients)
        section["modes"] = modes_throughput(model, workload, settings, seam_tokens=config.seam_tokens,
                                            modes=config.throughput_modes, show_progress=show_progress)
    if config.family_kinds:
        family_settings = ThroughputConfig(clients=(config.family_clients,), max_requests=config.family_requests,
                                           max_seconds=config.family_seconds)
        section["families"] = family_throughput(
            config.family_kinds, family_settings, chunk_tokens=config.chunk_tokens, pool_size=config.pool_size,
            seam_tokens=config.seam_tokens, tiny=config.family_tiny, show_progress=show_progress,
        )
    if config.batching_server:
        logger.info("throughput: server with the bundled model, %s clients", settings.clients)
        section["server"] = server_throughput(settings)
        logger.info("throughput: one server, one client against %d clients", config.server_clients)
        clients_settings = ThroughputConfig(clients=(1, config.server_clients), max_requests=config.batching_requests,
                                            max_seconds=config.batching_seconds)
        section["server_clients"] = server_clients(clients_settings, clients=config.server_clients)
        if config.server_workers > 1:
            logger.info("throughput: %d server workers, one client against %d clients", config.server_workers,
                        config.server_clients)
            section["server_clients_workers"] = server_clients(clients_settings, clients=config.server_clients,
                                                               workers=config.server_workers)
    return section
