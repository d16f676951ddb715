"""How long the shipped query embedder (all-MiniLM-L6-v2) takes on its light backend (no transformers import) and
on transformers' (`AutoTokenizer` + `AutoModel`), side by side, as JSON.

    OMP_WAIT_POLICY=PASSIVE python -m hypic_rag.bench.embedder_speed [--queries 50] [--batches 5] [--batch-size 8]
        [--fresh-runs 3] > embedder_speed.json

In this process: both backends loaded once, then `queries` different single questions embedded one at a time and
`batches` batches of `batch_size` questions, alternating the backends question by question; the medians and their
ratio (transformers / light). In fresh processes (`fresh_runs` of each, alternated; 0 skips them): the wall time of
a `python -c` that builds the embedder and embeds one question, as a one-shot `hypic-rag ask` does, with the
seconds to load it and to embed, and whether transformers was imported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

QUESTION = "What is the hobby of Gramux Mastem?"

_FRESH_CODE = """
import json, sys, time
began = time.perf_counter()
from hypic_rag.retrieval.embeddings import PooledStack, PooledTransformer, SentenceEmbedder
embedder = SentenceEmbedder()
model = PooledTransformer(embedder.path, PooledStack.read(embedder.path), backend=sys.argv[1])
loaded = time.perf_counter()
model.encode([sys.argv[2]], embedder.batch_size)
print(json.dumps({"load_s": loaded - began, "embed_s": time.perf_counter() - loaded,
                  "transformers_imported": "transformers" in sys.modules}))
"""


def questions(count: int) -> list[str]:
    """`count` different questions of 6 to about 30 words."""
    subjects = ["Gramux Mastem", "the astronomer born in 1979", "the second cache tier", "a hybrid attention model"]
    return [f"What is the {'really ' * (number % 7)}main hobby of {subjects[number % len(subjects)]} in year "
            f"{1900 + number}{', and why' * (number % 3)}?" for number in range(count)]


def _median_ms(times: list[float]) -> float:
    return round(statistics.median(times) * 1000, 3)


def in_process(query_count: int, batch_count: int, batch_size: int) -> dict[str, Any]:
    """Median ms per single query and per batch for both backends, measured alternately in this process."""
    from hypic_rag.retrieval.embeddings import PooledStack, PooledTransformer, default_embedder_path

    model_dir = default_embedder_path()
    stack = PooledStack.read(model_dir)
    backends = {name: PooledTransformer(model_dir, stack, backend=name) for name in ("light", "transformers")}
    for model in backends.values():
        model.encode([QUESTION], batch_size)  # warm-up
    single: dict[str, list[float]] = {name: [] for name in backends}
    for text in questions(query_count):
        for name, model in backends.items():
            began = time.perf_counter()
            model.encode([text], batch_size)
            single[name].append(time.perf_counter() - began)
    batched: dict[str, list[float]] = {name: [] for name in backends}
    texts = questions(batch_count * batch_size)
    for start in range(0, len(texts), batch_size):
        for name, model in backends.items():
            began = time.perf_counter()
            model.encode(texts[start:start + batch_size], batch_size)
            batched[name].append(time.perf_counter() - began)
    result: dict[str, Any] = {"single_query_ms": {name: _median_ms(times) for name, times in single.items()},
                              f"batch_of_{batch_size}_ms": {name: _median_ms(times) for name, times in batched.items()}}
    for row in list(result.values()):
        row["transformers_over_light"] = round(row["transformers"] / row["light"], 3)
    return result


def fresh_processes(runs: int) -> dict[str, Any]:
    """Wall seconds of a fresh process that builds the embedder and embeds one question, per backend (runs >= 1)."""
    environment = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    rows: dict[str, list[dict[str, Any]]] = {"light": [], "transformers": []}
    for _ in range(runs):
        for name, row in rows.items():
            began = time.perf_counter()
            finished = subprocess.run([sys.executable, "-c", _FRESH_CODE, name, QUESTION], capture_output=True,
                                      text=True, timeout=300, env=environment, check=True)
            row.append({"wall_s": round(time.perf_counter() - began, 3),
                        **{key: round(value, 3) if isinstance(value, float) else value
                           for key, value in json.loads(finished.stdout.strip().splitlines()[-1]).items()}})
    summary = {name: {"median_wall_s": statistics.median(run["wall_s"] for run in row), "runs": row}
               for name, row in rows.items()}
    summary["transformers_over_light"] = round(summary["transformers"]["median_wall_s"]
                                               / summary["light"]["median_wall_s"], 3)
    return summary


def measure(query_count: int = 50, batch_count: int = 5, batch_size: int = 8, fresh_runs: int = 3) -> dict[str, Any]:
    """The rows described in the module docstring."""
    import torch

    return {"benchmark": "query embedder", "embedder": "all-MiniLM-L6-v2", "torch_threads": torch.get_num_threads(),
            "queries": query_count, "batches": batch_count, "batch_size": batch_size,
            "in_process": in_process(query_count, batch_count, batch_size),
            "fresh_process": fresh_processes(fresh_runs) if fresh_runs else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", type=int, default=50, help="single questions embedded one at a time")
    parser.add_argument("--batches", type=int, default=5, help="batches embedded")
    parser.add_argument("--batch-size", type=int, default=8, help="questions per batch")
    parser.add_argument("--fresh-runs", type=int, default=3, help="fresh processes per backend (0: none)")
    args = parser.parse_args(argv)
    if min(args.queries, args.batches, args.batch_size) < 1 or args.fresh_runs < 0:
        parser.error("--queries, --batches and --batch-size must be positive, --fresh-runs at least 0")
    print(json.dumps(measure(args.queries, args.batches, args.batch_size, args.fresh_runs), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
