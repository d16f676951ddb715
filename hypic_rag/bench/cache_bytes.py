#!/usr/bin/env python
"""Segment-cache benchmark: bytes per chunk, load time per entry (disk cold/warm vs hot tier), and the quality
effect of the float16 / bfloat16 cache formats instead of float32 (every cache format: `bench.cache_formats`). Output: one JSON object (stdout and `--out`).

- bytes: a 4-layer `qwen3_5` model (3 linear + 1 attention layer) with Qwen3.5's per-layer dimensions (linear
  attention 16 key heads / 32 value heads x 128, attention 2 or 4 KV heads x 256; hidden and MLP sizes are small
  because entry shapes do not depend on them) is run to encode 256- and 1024-token chunks; the encoded value
  sizes are measured. The shapes derived from the config (`hypic_rag.cache.synthetic.entry_shapes`) are checked
  to match the encoded entry exactly, then full-depth layouts (transformers' Qwen3.5 defaults: 32 layers with 4 KV
  heads, and the Qwen3.5-35B-A3B layout: 40 layers with 2 KV heads) are sized by encoding entries of those shapes
  (random values) with the real codec.
- load: full-depth qwen3_5 entries in an LMDB store; per-entry time of `SegmentCache` hits served from disk with
  the OS page cache dropped for the file (cold: posix_fadvise DONTNEED after closing the map), from disk with the
  file in the page cache (warm), and from the hot tier.
- quality: tiny random `qwen3_5` models (slow decays), `hypic` mode through a `SegmentCache` per cache format;
  KL to `full` and to the float32-state run, top-1 agreement and max |logit difference|.

    OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 python -m hypic_rag.bench.cache_bytes --out runs/bench_cache.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hypic_rag.cache.codec import decode_entry, encode_entry
from hypic_rag.cache.keys import CacheNamespace, segment_key
from hypic_rag.cache.lmdb_store import LmdbSegmentStore
from hypic_rag.cache.segment_cache import SegmentCache
from hypic_rag.cache.store import SegmentStore
from hypic_rag.cache.synthetic import HybridShape, synthetic_entry
from hypic_rag.entry.schema import LINEAR_LAYER, Entry, entry_bytes
from hypic_rag.entry.compression import compress_entry

MIB = 1 << 20
CHUNK_LENGTHS = (256, 1024)


def qwen3_5_layer_dims(num_key_value_heads: int) -> dict[str, Any]:
    """Per-layer dimensions of Qwen3.5 (linear 16/32 heads x 128, attention 16 heads, KV heads x 256)."""
    return dict(
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_attention_heads=16, num_key_value_heads=num_key_value_heads, head_dim=256,
    )


def size_report(entry: Entry, cache_format: str = "float32") -> dict[str, int]:
    stored = compress_entry(entry, cache_format)
    sizes = entry_bytes(stored)
    return {
        "value_bytes": len(encode_entry(stored, "n" * 200)),
        "linear_bytes": sizes.linear_bytes,
        "kv_bytes": sizes.kv_bytes,
        "token_id_bytes": sizes.token_id_bytes,
    }


def layout(name: str, layers: int, kv_heads: int) -> HybridShape:
    from hypic_rag.testing import tiny_config

    config = tiny_config("qwen3_5", num_hidden_layers=layers, **qwen3_5_layer_dims(kv_heads))
    shape = HybridShape.from_config(config)
    logging.info("%s: %d layers, %d linear", name, layers, shape.layer_types.count(LINEAR_LAYER))
    return shape


def bench_bytes(encode_lengths: tuple[int, ...]) -> dict[str, Any]:
    """Measured on an encoded 4-layer model, then exact sizes of full-depth layouts via the codec."""
    from hypic_rag.runtime.engine import Engine
    from hypic_rag.runtime.model import wrap_model
    from hypic_rag.testing import build_tiny_model

    report: dict[str, Any] = {"measured_4_layer_encode": {}, "full_depth": {}}
    hf_model = build_tiny_model(
        "qwen3_5", seed=0, num_hidden_layers=4, hidden_size=256, intermediate_size=256,
        **qwen3_5_layer_dims(num_key_value_heads=4),
    )
    engine = Engine(wrap_model(hf_model), seam_tokens=8)
    shape = HybridShape.from_config(hf_model.config)
    for length in encode_lengths:
        ids = torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        began = time.perf_counter()
        entry = engine.encode_segment(ids)
        encode_seconds = time.perf_counter() - began
        measured = size_report(entry)
        from_shapes = size_report(synthetic_entry(shape, ids))
        if measured != from_shapes:
            raise AssertionError(f"shape formula disagrees with the encoded entry: {measured} vs {from_shapes}")
        report["measured_4_layer_encode"][str(length)] = dict(measured, encode_seconds=round(encode_seconds, 3))
    del engine, hf_model
    for name, layers, kv_heads in (("qwen3_5_default_32_layers", 32, 4), ("qwen3_5_35b_a3b_40_layers", 40, 2)):
        full_shape = layout(name, layers, kv_heads)
        per_length: dict[str, Any] = {}
        for length in CHUNK_LENGTHS:
            entry = synthetic_entry(full_shape, list(range(length)))
            per_length[str(length)] = {
                name: size_report(entry, name) for name in ("float32", "float16", "bfloat16")
            }
            del entry
        report["full_depth"][name] = per_length
    return report


def _drop_file_from_page_cache(path: Path) -> None:
    with path.open("rb") as handle:
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def bench_load(repeats: int, work_dir: Path) -> dict[str, Any]:
    """Per-entry load time of full-depth qwen3_5 entries: disk cold, disk warm, hot tier."""
    shape = layout("qwen3_5_default_32_layers", 32, 4)
    namespace = CacheNamespace("bench-model", "bench-tokenizer", 8)
    results: dict[str, Any] = {}
    for length in CHUNK_LENGTHS:
        directory = work_dir / f"load_{length}"
        chunks = [[length * 1000 + i] * length for i in range(repeats)]
        with SegmentCache.open(directory, disk_budget_bytes=16 << 30, hot_budget_bytes=0) as cache:
            cache.get_or_encode_many(namespace, chunks, lambda missing: [
                synthetic_entry(shape, ids, seed=ids[0]) for ids in missing])
            value_bytes = cache.stats()["bytes_per_entry"]

        def fail(_: list[int]) -> Entry:
            raise AssertionError("expected a hit")

        cold: list[float] = []
        for ids in chunks:  # cold: close the map, drop the file's pages, reopen, read one entry
            _drop_file_from_page_cache(directory / "data.mdb")
            with SegmentCache.open(directory, hot_budget_bytes=0) as cache:
                began = time.perf_counter()
                cache.get_or_encode(namespace, ids, fail)
                cold.append(time.perf_counter() - began)
        warm: list[float] = []
        hot: list[float] = []
        copy_only: list[float] = []
        decode_only: list[float] = []
        plain_copy: list[float] = []
        with SegmentCache.open(directory, hot_budget_bytes=0) as cache:
            for ids in chunks:
                cache.get_or_encode(namespace, ids, fail)  # pages now cached
            for ids in chunks:
                began = time.perf_counter()
                cache.get_or_encode(namespace, ids, fail)
                warm.append(time.perf_counter() - began)
        store: SegmentStore
        with LmdbSegmentStore.open(directory, readonly=True) as store:  # the store alone: copy, then decode
            for ids in chunks:
                began = time.perf_counter()
                value = store.get(segment_key(namespace, ids), touch=False)
                copy_only.append(time.perf_counter() - began)
                began = time.perf_counter()
                decode_entry(value)
                decode_only.append(time.perf_counter() - began)
                began = time.perf_counter()
                bytearray(value)
                plain_copy.append(time.perf_counter() - began)
                del value
        with SegmentCache.open(directory, hot_budget_bytes=4 << 30) as cache:
            for ids in chunks:
                cache.get_or_encode(namespace, ids, fail)  # fills the hot tier
            for _ in range(5):
                for ids in chunks:
                    began = time.perf_counter()
                    cache.get_or_encode(namespace, ids, fail)
                    hot.append(time.perf_counter() - began)
            assert cache.stats()["hot_hits"] == 5 * len(chunks)
        shutil.rmtree(directory)
        results[str(length)] = {
            "entries": repeats,
            "value_bytes": value_bytes,
            "disk_cold_ms_median": round(1000 * statistics.median(cold), 2),
            "disk_warm_ms_median": round(1000 * statistics.median(warm), 2),
            "disk_warm_copy_out_of_lmdb_ms_median": round(1000 * statistics.median(copy_only), 2),
            "decode_with_crc_ms_median": round(1000 * statistics.median(decode_only), 2),
            "reference_plain_bytearray_copy_ms_median": round(1000 * statistics.median(plain_copy), 2),
            "hot_tier_ms_median": round(1000 * statistics.median(hot), 4),
            "disk_warm_gb_per_s": round(value_bytes / statistics.median(warm) / 1e9, 2),
        }
    return results


def bench_quality(requests: int, models: int, work_dir: Path) -> dict[str, Any]:
    from hypic_rag.runtime.engine import Engine, Request
    from hypic_rag.runtime.model import wrap_model
    from hypic_rag.runtime.quality import kl_divergence
    from hypic_rag.testing import build_tiny_model

    rows: dict[str, list[dict[str, float]]] = {"float32": [], "float16": [], "bfloat16": []}
    for model_seed in range(models):
        model = wrap_model(build_tiny_model("qwen3_5", seed=model_seed, num_hidden_layers=8, hidden_size=128,
                                            linear_num_value_heads=8, linear_num_key_heads=4,
                                            linear_key_head_dim=32, linear_value_head_dim=32))
        generator = torch.Generator().manual_seed(100 + model_seed)
        batch = [Request(
            prefix_ids=torch.randint(0, 256, (8,), generator=generator).tolist(),
            chunk_ids=[torch.randint(0, 256, (n,), generator=generator).tolist() for n in (96, 64, 128, 80)],
            question_ids=torch.randint(0, 256, (12,), generator=generator).tolist(),
        ) for _ in range(requests)]
        full = [Engine(model, seam_tokens=8).prefill(request, mode="full").logits for request in batch]
        logits: dict[str, list[torch.Tensor]] = {}
        for dtype_name in rows:
            directory = work_dir / f"quality_{model_seed}_{dtype_name}"
            namespace = CacheNamespace.for_model(model, seam_tokens=8, cache_format=dtype_name)
            with SegmentCache.open(directory, disk_budget_bytes=1 << 30, namespace=namespace) as cache:
                engine = Engine(model, seam_tokens=8, segment_source=cache)
                logits[dtype_name] = [engine.prefill(request, mode="hypic").logits for request in batch]
            shutil.rmtree(directory)
        for dtype_name, outputs in logits.items():
            for reference, reference_fp32, output in zip(full, logits["float32"], outputs):
                rows[dtype_name].append({
                    "kl_to_full": kl_divergence(reference, output),
                    "kl_to_float32_state": kl_divergence(reference_fp32, output),
                    "top1_equals_float32_state": float(output.argmax() == reference_fp32.argmax()),
                    "max_abs_logit_diff_to_float32_state": float((output - reference_fp32).abs().max()),
                })
    return {
        dtype_name: {metric: float(f"{statistics.mean(row[metric] for row in values):.3g}") for metric in values[0]}
        | {"requests": len(values)}
        for dtype_name, values in rows.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="bytes,load,quality", help="comma list of bytes,load,quality")
    parser.add_argument("--load-entries", type=int, default=3, help="entries per chunk length for load timing")
    parser.add_argument("--quality-requests", type=int, default=6)
    parser.add_argument("--quality-models", type=int, default=2)
    parser.add_argument("--encode-lengths", default="256,1024", help="chunk lengths encoded by the 4-layer model")
    parser.add_argument("--work-dir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("hypic_rag.cache").setLevel(logging.WARNING)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    parts = set(args.parts.split(","))
    work_dir = Path(tempfile.mkdtemp(prefix="bench_cache_", dir=args.work_dir))
    report: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    try:
        if "bytes" in parts:
            began = time.perf_counter()
            report["bytes_per_chunk"] = bench_bytes(tuple(int(n) for n in args.encode_lengths.split(",")))
            logging.info("bytes done in %.1f s", time.perf_counter() - began)
        if "load" in parts:
            began = time.perf_counter()
            report["load_time_per_entry"] = bench_load(args.load_entries, work_dir)
            logging.info("load done in %.1f s", time.perf_counter() - began)
        if "quality" in parts:
            began = time.perf_counter()
            report["state_dtype_quality"] = bench_quality(args.quality_requests, args.quality_models, work_dir)
            logging.info("quality done in %.1f s", time.perf_counter() - began)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
