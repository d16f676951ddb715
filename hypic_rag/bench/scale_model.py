"""A model, not a measurement: throughput, cache bytes and network traffic of 1M chunks on 8 and 64 GPUs.

    python -m hypic_rag.bench.scale_model --output docs/benchmarks    # writes scale_model.json (seconds to run)

Three parts, every input named in `Assumptions` (docs/scale.md discusses them):

1. closed form: entry bytes from the entry format (`entry/schema.py`, docs/CONTRACTS.md) at a Qwen3.5-9B-class layout,
   encode time from tokens/s per GPU, precompute time as the slower of compute and the write path (one writer
   as `precompute --ray` runs today, or one writer per node / straight to a remote tier), and cache bytes;
2. simulation of segment parallelism: a request's misses scheduled longest first over g encoders
   (`ray_encoder.lpt_assignment`, the scheduler `RayEncoderPool` runs) against one encoder;
3. simulation of cache-affinity routing: Zipf-popular requests of k chunks over R replicas, each with an LRU hot
   tier, routed by rendezvous hashing (`rendezvous.owner`, what the front does) or at random; hot-tier hit rate
   and the bytes that must come from below the hot tier.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hypic_rag.distributed.ray_encoder import lpt_assignment
from hypic_rag.distributed.rendezvous import owner

MIB = 1 << 20
GB = 1e9


@dataclass(frozen=True, slots=True)
class Layout:
    """A hybrid model's per-layer shapes (Qwen3.5-9B class: transformers' `Qwen3_5TextConfig` defaults, 32 layers
    repeating 3 Gated DeltaNet + 1 gated attention, hidden 4096, MLP 12288, vocab 248320, about 9.0B parameters)."""

    name: str = "Qwen3.5-9B class (Qwen3_5TextConfig defaults)"
    linear_layers: int = 24
    attention_layers: int = 8
    value_heads: int = 32  # Gated DeltaNet value heads (P and Z per value head)
    key_dim: int = 128
    value_dim: int = 128
    conv_dim: int = 8192  # 2 * 16 key heads * 128 + 32 value heads * 128
    conv_kernel: int = 4
    kv_heads: int = 4
    head_dim: int = 256
    encode_gflop_per_token: float = 14.0  # 2 x ~7B parameters the stack runs (no lm_head when encoding)


@dataclass(frozen=True, slots=True)
class Assumptions:
    chunks: int = 1_000_000
    chunk_tokens: int = 256
    state_bytes: int = 2  # P and Z stored in bfloat16 (float32: 4, the HYPIC paper's choice)
    kv_bytes: int = 2  # a bfloat16 model's K/V
    encode_tokens_per_s_per_gpu: float = 20_000.0  # ~29% of an H100/H200's 989 dense bf16 TFLOP/s at 14 GFLOP/token
    gpus_per_node: int = 8
    single_writer_bytes_per_s: float = 3 * GB  # one LMDB writer on NVMe, sustained
    node_write_bytes_per_s: float = 25 * GB  # one node's path to storage: 200 Gb/s NIC to an object store
    pcie_bytes_per_s: float = 50 * GB  # host -> GPU, PCIe 5 x16
    nvme_bytes_per_s: float = 6 * GB
    remote_bytes_per_s_per_request: float = 2 * GB  # parallel ranged GETs of one request's entries
    host_hot_tier_bytes_per_node: float = 1e12  # 1 TB of a node's host memory for hot tiers
    requests_per_s_per_gpu: float = 10.0
    chunks_per_request: int = 8
    zipf_exponent: float = 1.0


def entry_bytes(layout: Layout, a: Assumptions) -> dict[str, float]:
    """Bytes of one chunk's entry (format 2): per linear layer P [H, K, K] and Z [H, K, V] in the state dtype and
    the conv tail [conv_dim, kernel - 1]; per attention layer K and V [kv_heads, L, head_dim]."""
    per_linear = (layout.value_heads * layout.key_dim * (layout.key_dim + layout.value_dim) * a.state_bytes
                  + layout.conv_dim * (layout.conv_kernel - 1) * a.kv_bytes)
    per_attention = 2 * layout.kv_heads * a.chunk_tokens * layout.head_dim * a.kv_bytes
    linear, kv = layout.linear_layers * per_linear, layout.attention_layers * per_attention
    return {"linear_state": linear, "kv": kv, "total": linear + kv}


def precompute_model(layout: Layout, a: Assumptions, gpus: int) -> dict[str, Any]:
    """Precompute of `a.chunks` chunks on `gpus` GPUs: compute-bound time, the time each write path allows."""
    entry = entry_bytes(layout, a)["total"]
    tokens = a.chunks * a.chunk_tokens
    compute_s = tokens / (gpus * a.encode_tokens_per_s_per_gpu)
    produced = gpus * a.encode_tokens_per_s_per_gpu / a.chunk_tokens * entry  # bytes/s the GPUs emit
    nodes = math.ceil(gpus / a.gpus_per_node)
    single_s = a.chunks * entry / min(produced, a.single_writer_bytes_per_s)
    sharded_s = a.chunks * entry / min(produced, nodes * a.node_write_bytes_per_s)
    return {
        "gpus": gpus, "nodes": nodes, "tokens": tokens,
        "compute_bound_s": round(compute_s, 1),
        "entries_bytes_per_s_produced": round(produced),
        "single_writer_s": round(max(compute_s, single_s), 1),
        "single_writer_bound_by": "writer" if single_s > compute_s else "compute",
        "writer_per_node_s": round(max(compute_s, sharded_s), 1),
        "writer_per_node_bound_by": "network/storage" if sharded_s > compute_s else "compute",
        "cache_bytes": a.chunks * entry,
        "network_bytes_to_writers": a.chunks * entry,
    }


def lpt_speedup(encoders: int, *, chunks: int, min_tokens: int, max_tokens: int, trials: int, seed: int) -> dict[str, float]:
    """Mean makespan speed-up of LPT over `encoders` against one, for requests of `chunks` misses of uniform lengths
    (cost: tokens; attention's quadratic part is small at these lengths), and against the ideal (sum / encoders)."""
    rng = random.Random(seed)
    speedups, efficiency = [], []
    for _ in range(trials):
        costs = [rng.randint(min_tokens, max_tokens) for _ in range(chunks)]
        makespan = max(sum(costs[i] for i in group) for group in lpt_assignment(costs, encoders))
        speedups.append(sum(costs) / makespan)
        efficiency.append(sum(costs) / encoders / makespan)
    return {"encoders": encoders, "speedup": round(sum(speedups) / trials, 3),
            "of_ideal": round(sum(efficiency) / trials, 3)}


class _LRU:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: OrderedDict[int, None] = OrderedDict()

    def get_or_put(self, key: int) -> bool:
        if key in self.items:
            self.items.move_to_end(key)
            return True
        self.items[key] = None
        if len(self.items) > self.capacity:
            self.items.popitem(last=False)
        return False


def routing_simulation(
    replicas: int, *, chunks: int, capacity_per_replica: int, requests: int, k: int, zipf: float, seed: int,
    queries: int | None = None,
) -> dict[str, Any]:
    """Hot-tier hit rate over `replicas` LRU hot tiers of `capacity_per_replica` entries, with requests routed by
    rendezvous hashing over their chunk ids (the owner of most of them) or at random.

    Two workloads: `queries` None: each request draws `k` chunks independently, Zipf(`zipf`) over `chunks` (no
    two requests alike: the pessimistic case for request-level routing); else `queries` distinct questions, each a
    fixed set of `k` Zipf-drawn chunks, asked with Zipf(`zipf`) popularity (a question asked again retrieves the
    same chunks, as repeated and similar questions do)."""
    rng = random.Random(seed)
    names = [f"replica-{n}" for n in range(replicas)]
    cumulative, total = _zipf_cumulative(chunks, zipf)
    def draw() -> int:
        return min(chunks - 1, _bisect(cumulative, rng.random() * total))

    if queries is None:
        stream = [[draw() for _ in range(k)] for _ in range(requests)]
    else:
        asked = [[draw() for _ in range(k)] for _ in range(queries)]
        query_cumulative, query_total = _zipf_cumulative(queries, zipf)
        stream = [asked[min(queries - 1, _bisect(query_cumulative, rng.random() * query_total))] for _ in range(requests)]
    owners: dict[int, int] = {}

    def owner_of(chunk: int) -> int:
        if chunk not in owners:
            owners[chunk] = names.index(owner(names, str(chunk)))
        return owners[chunk]

    results = {}
    for policy in ("rendezvous", "random"):
        tiers = [_LRU(capacity_per_replica) for _ in range(replicas)]
        picker = random.Random(seed + 1)
        hits = lookups = 0
        for request in stream:
            if policy == "rendezvous":
                counts = [0] * replicas
                for chunk in set(request):
                    counts[owner_of(chunk)] += 1
                target = max(range(replicas), key=lambda r: (counts[r], -r))
            else:
                target = picker.randrange(replicas)
            for chunk in request:
                hits += tiers[target].get_or_put(chunk)
                lookups += 1
        results[policy] = round(hits / lookups, 4)
    return {"replicas": replicas, "capacity_per_replica": capacity_per_replica,
            "workload": "independent chunks" if queries is None else f"{queries} repeated questions",
            "hot_hit_rate": results}


def _zipf_cumulative(count: int, exponent: float) -> tuple[list[float], float]:
    cumulative, total = [], 0.0
    for rank in range(count):
        total += 1.0 / (rank + 1) ** exponent
        cumulative.append(total)
    return cumulative, total


def _bisect(cumulative: list[float], value: float) -> int:
    low, high = 0, len(cumulative)
    while low < high:
        middle = (low + high) // 2
        if cumulative[middle] < value:
            low = middle + 1
        else:
            high = middle
    return low


def harmonic(m: int) -> float:
    """H(m) ~ ln m + 0.5772: the mass of the top m chunks under Zipf(1.0), unnormalised."""
    return math.log(m) + 0.5772 if m > 0 else 0.0


def _below_hot_tier(requests_per_s: float, chunks_per_request: int, entry: float) -> Any:
    """Bytes/s read from below the hot tier at a hit rate."""
    return lambda hit: requests_per_s * chunks_per_request * (1 - hit) * entry


def run_model(a: Assumptions = Assumptions(), layout: Layout = Layout(), *, simulate: bool = True) -> dict[str, Any]:
    bf16 = entry_bytes(layout, a)
    fp32 = entry_bytes(layout, Assumptions(**{**asdict(a), "state_bytes": 4}))
    result: dict[str, Any] = {
        "kind": "model and simulation (not a measurement)",
        "assumptions": asdict(a), "layout": asdict(layout),
        "entry_bytes": {"state_bf16": bf16, "state_fp32": fp32,
                        "state_bf16_mib": round(bf16["total"] / MIB, 2), "state_fp32_mib": round(fp32["total"] / MIB, 2)},
        "precompute": [precompute_model(layout, a, gpus) for gpus in (1, 8, 64)],
    }
    entry = bf16["total"]
    hot_entries_per_replica = int(a.host_hot_tier_bytes_per_node / a.gpus_per_node / entry)
    result["serving"] = []
    for gpus in (8, 64):
        distinct_hot_affine = min(a.chunks, gpus * hot_entries_per_replica)
        hit_affine = harmonic(distinct_hot_affine) / harmonic(a.chunks)
        hit_random = harmonic(hot_entries_per_replica) / harmonic(a.chunks)
        requests = gpus * a.requests_per_s_per_gpu
        below = _below_hot_tier(requests, a.chunks_per_request, entry)
        result["serving"].append({
            "gpus": gpus, "hot_entries_per_replica": hot_entries_per_replica,
            "distinct_hot_entries": {"perfect_partition": distinct_hot_affine, "random": hot_entries_per_replica},
            "hot_hit_rate_zipf1_bound": {"perfect_partition": round(hit_affine, 3), "random": round(hit_random, 3)},
            "bytes_per_s_below_hot_tier": {"perfect_partition": round(below(hit_affine)),
                                           "random": round(below(hit_random))},
            "request_load_ms": {
                "hot_tier_over_pcie": round(a.chunks_per_request * entry / a.pcie_bytes_per_s * 1e3, 1),
                "local_nvme": round(a.chunks_per_request * entry / a.nvme_bytes_per_s * 1e3, 1),
                "remote_tier": round(a.chunks_per_request * entry / a.remote_bytes_per_s_per_request * 1e3, 1),
                "encode_all_misses_one_gpu": round(a.chunks_per_request * a.chunk_tokens
                                                   / a.encode_tokens_per_s_per_gpu * 1e3, 1),
            },
        })
    if simulate:
        result["segment_parallelism_lpt"] = [
            lpt_speedup(g, chunks=16, min_tokens=64, max_tokens=1024, trials=2000, seed=0) for g in (1, 2, 4, 8)]
        result["routing_simulation"] = {
            "scaled_down": "50k chunks, Zipf 1.0, 8 chunks per request, 30k requests; hot tier per replica 0.2% of "
                           "the chunks (the closed form's 2,086 of 1M); repeated questions: 20k distinct",
            "runs": [routing_simulation(r, chunks=50_000, capacity_per_replica=100, requests=30_000, k=8, zipf=1.0,
                                        seed=3, queries=queries)
                     for queries in (None, 20_000) for r in (8, 64)],
        }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=".", help="directory for scale_model.json")
    parser.add_argument("--no-simulation", action="store_true", help="closed form only")
    args = parser.parse_args(argv)
    result = run_model(simulate=not args.no_simulation)
    path = Path(args.output)
    path.mkdir(parents=True, exist_ok=True)
    (path / "scale_model.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({key: result[key] for key in ("entry_bytes", "precompute")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
