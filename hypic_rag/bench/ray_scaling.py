"""Encoding throughput on Ray: 1 vs 2 encoding actors against this process alone (`hypic-rag bench --ray-scaling`).

The model is a random qwen3_5 checkpoint written to a temporary directory (actors load it from a path, as in
`precompute --ray`): 8 layers (6 Gated DeltaNet, 2 attention), hidden 256, 512-token BPE, the size of the
precompute measurements in docs/retrieval.md. The segments are synthetic token ids of mixed lengths, encoded in the
batches `get_or_encode.encoding_batches` plans (the same as precompute), longest first. Each configuration runs
`repeats` times after one warm-up pass; actor start-up (process start, imports, model load) is timed apart.

On a 2-core machine shared with other jobs, two actors cannot show the speed-up they give on two free cores (or
two GPUs): the JSON records the load average before and after so a reader can judge. docs/scale.md models what
the same scheduling gives on 8 and 64 GPUs.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hypic_rag.runtime.get_or_encode import SegmentTask, encoding_batches

DEFAULT_SEGMENTS = 64
MODEL_SHAPE: dict[str, Any] = {"hidden_size": 256, "num_hidden_layers": 8, "intermediate_size": 512,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                               "linear_num_key_heads": 4, "linear_num_value_heads": 8,
                               "linear_key_head_dim": 32, "linear_value_head_dim": 32}


@dataclass(frozen=True, slots=True)
class ScalingConfig:
    """segments: how many to encode per pass, lengths uniform in [min_tokens, max_tokens]; actor_counts: the Ray
    configurations; repeats: timed passes each (after one warm-up)."""

    segments: int = DEFAULT_SEGMENTS
    min_tokens: int = 32
    max_tokens: int = 256
    actor_counts: tuple[int, ...] = (1, 2)
    repeats: int = 2
    seam_tokens: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if self.segments < 1 or self.repeats < 1 or not self.actor_counts or min(self.actor_counts) < 1:
            raise ValueError("segments, repeats and every actor count must be positive")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError("need 1 <= min_tokens <= max_tokens")


QUICK = ScalingConfig()
TEST = ScalingConfig(segments=12, max_tokens=64, repeats=1)


def synthetic_tasks(config: ScalingConfig, vocab: int) -> list[SegmentTask]:
    """`config.segments` segments of random token ids (3..vocab-1) and lengths, for seam `config.seam_tokens`."""
    rng = random.Random(config.seed)
    return [SegmentTask(tuple(rng.randrange(3, vocab) for _ in range(rng.randint(config.min_tokens, config.max_tokens))),
                        config.seam_tokens) for _ in range(config.segments)]


def _timed(run: Any, repeats: int) -> list[float]:
    run()  # warm-up
    seconds = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - began)
    return seconds


def run_scaling(config: ScalingConfig = QUICK, *, ray_address: str = "local") -> dict[str, Any]:
    """Measure and return the JSON-ready result (tokens/s of this process alone and of each actor count)."""
    from hypic_rag.distributed.cluster import ClusterConfig, connect, disconnect_if_local
    from hypic_rag.distributed.ray_encoder import RayEncoderPool
    from hypic_rag.retrieval.encoding_pool import EncoderConfig
    from hypic_rag.runtime.engine import Engine
    from hypic_rag.runtime.model import load_model
    from hypic_rag.testing import save_tiny_checkpoint

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="hypic-ray-bench-") as directory:
        texts = [" ".join(f"word{n % 97} item{n % 13}" for n in range(i, i + 40)) for i in range(200)]
        model_path = save_tiny_checkpoint(Path(directory) / "model", texts, **MODEL_SHAPE)
        model = load_model(model_path, device="cpu")
        engine = Engine(model, seam_tokens=config.seam_tokens)
        tasks = synthetic_tasks(config, int(model.config.vocab_size))
        tokens = sum(len(task.token_ids) for task in tasks)
        batches = encoding_batches(tasks, engine.encode_batch_tokens)

        def here() -> None:
            for batch in batches:
                engine.encode_segments([list(tasks[p].token_ids) for p in batch], config.seam_tokens)

        rows = [{"encoder": "this process", "actors": 0, "threads": torch.get_num_threads(),
                 "seconds": _timed(here, config.repeats)}]
        cluster = ClusterConfig(address=ray_address)
        ray = connect(cluster)
        try:
            spec = EncoderConfig(model_path=str(model_path), device="cpu", dtype=model.dtype_name,
                               seam_tokens=config.seam_tokens, fingerprint=model.fingerprint, threads_per_worker=1,
                               preload_modules=())
            for actors in config.actor_counts:
                with RayEncoderPool(ray, spec, actors=actors, encode_batch_tokens=engine.encode_batch_tokens) as pool:
                    began = time.perf_counter()
                    pool.start()
                    startup = time.perf_counter() - began
                    seconds = _timed(lambda: sum(1 for _ in pool.encode(tasks)), config.repeats)
                rows.append({"encoder": "ray actors", "actors": actors, "threads": 1, "seconds": seconds,
                             "startup_seconds": round(startup, 3)})
        finally:
            disconnect_if_local(ray, cluster)
    for row in rows:
        best = min(row["seconds"])
        row["seconds"] = [round(value, 4) for value in row["seconds"]]
        row["median_seconds"] = round(statistics.median(row["seconds"]), 4)
        row["tokens_per_second"] = round(tokens / best, 1)
    one = next((row for row in rows if row["actors"] == 1), None)
    for row in rows:
        if one is not None and row["actors"]:
            row["speedup_vs_1_actor"] = round(row["tokens_per_second"] / one["tokens_per_second"], 3)
    return {
        "benchmark": "ray_scaling",
        "config": asdict(config),
        "model": {"kind": "random qwen3_5", **MODEL_SHAPE, "layers": "6 linear + 2 attention"},
        "segments": len(tasks),
        "tokens": tokens,
        "batches": len(batches),
        "rows": rows,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "load_average_before": [round(v, 2) for v in load_before],
                    "load_average_after": [round(v, 2) for v in os.getloadavg()]},
        "note": ("Measured on a 2-core machine shared with other agents' jobs: tokens/s of 2 actors against 1 shows "
                 "the scheduling and transfer overhead here, not the scaling on free cores or GPUs; see docs/scale.md."),
    }


def write_scaling(result: dict[str, Any], output: Path) -> Path:
    """Write `result` as `ray_scaling.json` in `output` (created); its path."""
    output.mkdir(parents=True, exist_ok=True)
    path = output / "ray_scaling.json"
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return path


def markdown_row(result: dict[str, Any]) -> str:
    """A short table of the result."""
    lines = ["| encoder | actors | tokens/s | median s | start-up s | vs 1 actor |", "| --- | --- | --- | --- | --- | --- |"]
    for row in result["rows"]:
        lines.append(f"| {row['encoder']} | {row['actors']} | {row['tokens_per_second']} | {row['median_seconds']} | "
                     f"{row.get('startup_seconds', '-')} | {row.get('speedup_vs_1_actor', '-')} |")
    return "\n".join(lines)
