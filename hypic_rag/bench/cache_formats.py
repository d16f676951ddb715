"""Cache formats side by side (`hypic-rag bench --sections cache_formats`): bytes, quality, load time and TTFT.

- bytes: every family's entry at its published checkpoint's shapes (`family_bytes`: the runtime's own encoder on
  the meta device, no weights) for 256- and 1024-token chunks, compressed by each format on the meta device (the
  real code path: shapes and dtypes only), against two float32 references: the model run in float32 (every tensor
  float32, as the CPU runtime stores entries) and in bfloat16 (K/V bfloat16 already, as on CUDA).
- quality: tiny random models of every family (`family_models`, slow decays, peaked attention); per request
  KL(float32 entries || format entries) of `hypic`'s next-token distribution (`calibration.cache_format.score_formats`),
  its mean and 99th percentile, and greedy next-token agreement. Exact match on trained checkpoints is
  `evals/cache_formats.py` (repository-only).
- load: full-depth Qwen3.5-35B-A3B entries (random values) in an LMDB store per format; per entry the disk read
  (copy out of LMDB, crc32, header), the decode to float32 (`decompress_entry`), cold (the file's pages dropped:
  posix_fadvise DONTNEED) and warm.
- ttft: `hypic` time to first token (the prefill, cache load and decode included) of the standard timing model
  (qwen3_5 "medium", 174M) over k chunks served from an LMDB cache per format (hot tier off, so every request reads
  the disk store), warm and cold, interleaved over formats; medians and the ratio to float32 entries.

Output: `cache_formats.json` and `cache_formats.md` (`_<profile>` for other profiles).
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hypic_rag.entry.schema import Entry, entry_bytes
from hypic_rag.entry.compression import CACHE_FORMATS, DEFAULT_CACHE_FORMAT, compress_entry, decompress_entry

logger = logging.getLogger(__name__)

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class CacheFormatsConfig:
    """What one run measures. parts: among bytes, quality, load, ttft."""

    profile: str
    formats: tuple[str, ...] = tuple(CACHE_FORMATS)
    parts: tuple[str, ...] = ("bytes", "quality", "load", "ttft")
    byte_families: tuple[str, ...] | None = None
    chunk_lengths: tuple[int, ...] = (256, 1024)
    model_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    quality_families: tuple[str, ...] | None = None
    quality_requests: int = 16
    quality_seed: int = 0
    load_layers: int = 40
    load_entries: int = 2
    ttft_model: str = "medium"
    ttft_requests: int = 3
    ttft_chunks: int = 8
    ttft_chunk_tokens: int = 256
    ttft_threads: int = 2

    def __post_init__(self) -> None:
        unknown = [name for name in self.formats if name not in CACHE_FORMATS]
        if unknown or DEFAULT_CACHE_FORMAT not in self.formats:
            raise ValueError(f"formats must be known and include float32, got {self.formats}")
        if set(self.parts) - {"bytes", "quality", "load", "ttft"}:
            raise ValueError(f"parts are among bytes, quality, load, ttft; got {self.parts}")


PROFILES = {
    "standard": CacheFormatsConfig("standard"),
    "test": CacheFormatsConfig(
        "test", formats=("float32", "int8", "int4"), byte_families=("lfm2",), chunk_lengths=(64,),
        model_dtypes=("bfloat16",), quality_families=("qwen3_5",), quality_requests=2, load_layers=4, load_entries=1,
        ttft_model="tiny", ttft_requests=1, ttft_chunks=2, ttft_chunk_tokens=32, ttft_threads=1,
    ),
}


# ============================================================================================== bytes
def format_bytes(entry: Entry, formats: Sequence[str]) -> dict[str, int]:
    """Tensor bytes of `entry` (meta tensors are fine) in each format."""
    return {name: entry_bytes(compress_entry(entry, name)).tensor_bytes for name in formats}


def bytes_rows(config: CacheFormatsConfig) -> list[dict[str, Any]]:
    """Per family, chunk length and model dtype: bytes per format and their ratio to the float32 format's."""
    from hypic_rag.bench.family_bytes import layout_entry, meta_model
    from hypic_rag.bench.published_layouts import PUBLISHED_LAYOUTS

    rows = []
    for family in config.byte_families or tuple(PUBLISHED_LAYOUTS):
        layout = PUBLISHED_LAYOUTS[family]
        for dtype in (getattr(torch, name) for name in config.model_dtypes):
            model = meta_model(layout.config(), dtype)
            for length in config.chunk_lengths:
                sizes = format_bytes(layout_entry(model, length), config.formats)
                rows.append({"model_type": family, "checkpoint": layout.checkpoint,
                             "model_dtype": str(dtype).removeprefix("torch."), "chunk_tokens": length,
                             "bytes": sizes, "ratio": {name: size / sizes["float32"] for name, size in sizes.items()}})
            del model
    return rows


# ============================================================================================== quality
def quality_rows(config: CacheFormatsConfig) -> list[dict[str, Any]]:
    """Per family: every format's KL against float32 entries over random requests on a tiny random model."""
    from hypic_rag.bench.family_models import TIMING_FAMILIES, build_family_timing_model
    from hypic_rag.calibration.cache_format import score_formats
    from hypic_rag.runtime.engine import Engine
    from hypic_rag.runtime.model import wrap_model

    candidates = [name for name in config.formats if name != DEFAULT_CACHE_FORMAT]
    rows = []
    for family in config.quality_families or TIMING_FAMILIES:
        began = time.perf_counter()
        model = wrap_model(build_family_timing_model(family, seed=config.quality_seed, tiny=True))
        engine = Engine(model, seam_tokens=8)
        requests = random_requests(model.config.vocab_size, config.quality_requests, config.quality_seed, chunks=4,
                                   chunk_tokens=(48, 128))
        scores = score_formats(engine, requests, candidates)
        rows.append({"model_type": family, "requests": len(requests), "seconds": round(time.perf_counter() - began, 1),
                     "formats": {score.cache_format: score.to_dict() for score in scores}})
        logger.info("quality of %s: %.0f s", family, rows[-1]["seconds"])
    return rows


def random_requests(vocabulary: int, count: int, seed: int, *, chunks: int, chunk_tokens: tuple[int, int],
                    prefix_tokens: int = 8, question_tokens: int = 10) -> list[Any]:
    """`count` requests of seeded random token ids: a prefix, `chunks` chunks of lengths drawn in `chunk_tokens`
    (inclusive bounds), a question."""
    from hypic_rag.runtime.request import Request

    generator = torch.Generator().manual_seed(1000 + seed)

    def ids(length: int) -> list[int]:
        return torch.randint(0, vocabulary, (length,), generator=generator).tolist()

    low, high = chunk_tokens
    return [Request(ids(prefix_tokens),
                    [ids(int(torch.randint(low, high + 1, (1,), generator=generator))) for _ in range(chunks)],
                    ids(question_tokens)) for _ in range(count)]


# ============================================================================================== load
def drop_page_cache(path: Path) -> None:
    """Ask the OS to drop `path`'s cached pages (clean pages: LMDB fsyncs every commit)."""
    with path.open("rb") as handle:
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def load_rows(config: CacheFormatsConfig, work_dir: Path) -> list[dict[str, Any]]:
    """Per format: time to read one full-depth entry from disk (cold and warm) and to decode it to float32."""
    from hypic_rag.bench.cache_bytes import layout
    from hypic_rag.cache.keys import CacheNamespace
    from hypic_rag.cache.segment_cache import SegmentCache
    from hypic_rag.cache.synthetic import synthetic_entry

    shape = layout("qwen3_5_35b_a3b", config.load_layers, 2)
    token_lists = [list(range(n * 1000, n * 1000 + 256)) for n in range(config.load_entries)]
    rows = []
    for name in config.formats:
        namespace = CacheNamespace("bench-model", "bench-tokenizer", 8, cache_format=name)
        directory = work_dir / f"load_{name}"
        with SegmentCache.open(directory, disk_budget_bytes=64 << 30, hot_budget_bytes=0) as cache:
            for number, ids in enumerate(token_lists):
                cache.put_many(namespace, [ids], [synthetic_entry(shape, ids, seed=number)])
            stored = cache.stored_bytes(namespace, token_lists) // len(token_lists)
        timings: dict[str, list[float]] = {"disk_cold": [], "disk_warm": [], "decode": []}
        for ids in token_lists:
            for warmth in ("disk_cold", "disk_warm"):
                if warmth == "disk_cold":
                    drop_page_cache(directory / "data.mdb")
                with SegmentCache.open(directory, readonly=True, hot_budget_bytes=0) as cache:
                    began = time.perf_counter()
                    entry = cache.get_many(namespace, [ids])[0]
                    read = time.perf_counter()
                    assert entry is not None, "a stored entry must hit"
                    decompress_entry(entry, "cpu", torch.float32)
                    timings[warmth].append(read - began)
                    timings["decode"].append(time.perf_counter() - read)
        shutil.rmtree(directory)
        rows.append({"cache_format": name, "value_bytes": stored, "entries": len(token_lists),
                     **{f"{part}_ms": round(1000 * statistics.median(values), 2) for part, values in timings.items()}})
        logger.info("load of %s: %s", name, rows[-1])
    return rows


# ============================================================================================== ttft
def ttft_rows(config: CacheFormatsConfig, work_dir: Path) -> dict[str, Any]:
    """`hypic` TTFT per format from an LMDB cache, warm and cold (see the module), medians over the requests."""
    from hypic_rag.bench.timing_model import build_timing_model
    from hypic_rag.cache.keys import CacheNamespace
    from hypic_rag.cache.segment_cache import SegmentCache
    from hypic_rag.runtime.engine import Engine
    from hypic_rag.runtime.model import wrap_model
    from hypic_rag.runtime.modes import PREFIX_ENTRY_SEAM
    from hypic_rag.runtime.quality import kl_divergence

    threads = torch.get_num_threads()
    torch.set_num_threads(config.ttft_threads)
    try:
        model = wrap_model(build_timing_model(config.ttft_model))
        chunk = config.ttft_chunk_tokens
        requests = random_requests(model.config.vocab_size, config.ttft_requests, 7, chunks=config.ttft_chunks,
                                   chunk_tokens=(chunk, chunk), prefix_tokens=32, question_tokens=24)
        reference = Engine(model, seam_tokens=8)  # encodes each entry once, in float32
        entries = {(PREFIX_ENTRY_SEAM, tuple(request.prefix_ids)): None for request in requests}
        entries.update({(8, tuple(ids)): None for request in requests for ids in request.chunk_ids})
        for seam, ids in list(entries):
            entries[(seam, ids)] = reference.encode_segment(list(ids), seam)
        directories = {name: work_dir / f"ttft_{name}" for name in config.formats}
        stored: dict[str, int] = {}
        for name, directory in directories.items():  # every format's store holds the same entries
            namespace = CacheNamespace.for_model(model, 8, name)
            with SegmentCache.open(directory, disk_budget_bytes=64 << 30, hot_budget_bytes=0) as cache:
                for (seam, ids), entry in entries.items():
                    cache.put_many(namespace.with_seam(seam), [list(ids)], [entry])
                stored[name] = sum(cache.stored_bytes(namespace.with_seam(seam), [list(ids)]) for seam, ids in entries)
        samples: dict[str, dict[str, list[float]]] = {name: {"warm": [], "cold": [], "load_warm": [], "load_cold": []}
                                                      for name in config.formats}
        logits: dict[str, list[torch.Tensor]] = {name: [] for name in config.formats}
        for request in requests:
            for warmth in ("cold", "warm"):
                for name in config.formats:  # interleaved: the machine's drift touches every format alike
                    if warmth == "cold":
                        drop_page_cache(directories[name] / "data.mdb")
                    namespace = CacheNamespace.for_model(model, 8, name)
                    with SegmentCache.open(directories[name], readonly=True, hot_budget_bytes=0,
                                           namespace=namespace) as cache:
                        engine = Engine(model, seam_tokens=8, segment_source=cache)
                        began = time.perf_counter()
                        result = engine.prefill(request, "hypic")
                        samples[name][warmth].append(time.perf_counter() - began)
                        samples[name][f"load_{warmth}"].append(result.stats.load_seconds)
                        assert result.stats.cache_misses == 0, "every entry was stored before timing"
                        if warmth == "warm":
                            logits[name].append(result.logits)
        medians = {name: {part: statistics.median(values) for part, values in parts.items()}
                   for name, parts in samples.items()}
        base = medians[DEFAULT_CACHE_FORMAT]
        rows = [{"cache_format": name, **{f"{part}_ms": round(1000 * value, 1) for part, value in parts.items()},
                 "warm_vs_float32": parts["warm"] / base["warm"], "cold_vs_float32": parts["cold"] / base["cold"],
                 "kl_vs_float32": statistics.fmean(kl_divergence(a, b) for a, b in
                                                   zip(logits[DEFAULT_CACHE_FORMAT], logits[name]))}
                for name, parts in medians.items()]
        return {"model": config.ttft_model, "parameters": sum(p.numel() for p in model.hf_model.parameters()),
                "requests": config.ttft_requests, "chunks": config.ttft_chunks, "chunk_tokens": chunk,
                "prompt_tokens": requests[0].prompt_tokens, "threads": config.ttft_threads,
                "value_bytes_per_request": {name: size // len(requests) for name, size in stored.items()},
                "rows": rows}
    finally:
        torch.set_num_threads(threads)


# ============================================================================================== report
def run_cache_formats(config: CacheFormatsConfig, *, command: str, work_dir: Path | None = None) -> dict[str, Any]:
    """The parts of `config`; the result dict `cache_formats_markdown` renders."""
    from hypic_rag.bench.run import machine_description

    began, load_before = time.time(), os.getloadavg()
    scratch = Path(tempfile.mkdtemp(prefix="bench_formats_", dir=work_dir))
    result: dict[str, Any] = {"benchmark": "hypic-rag cache formats", "command": command,
                              "machine": machine_description(), "load_average_before": list(load_before),
                              "config": {name: getattr(config, name) for name in config.__slots__},
                              "formats": {name: CACHE_FORMATS[name].codings() for name in config.formats}}
    try:
        for part, run in (("bytes", lambda: bytes_rows(config)), ("quality", lambda: quality_rows(config)),
                          ("load", lambda: load_rows(config, scratch)), ("ttft", lambda: ttft_rows(config, scratch))):
            if part in config.parts:
                started = time.perf_counter()
                result[part] = run()
                logger.info("cache formats %s: %.0f s", part, time.perf_counter() - started)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result["load_average_after"] = list(os.getloadavg())
    result["seconds"] = round(time.time() - began, 1)
    return result


def _mib(value: float) -> str:
    return f"{value / MIB:.2f}"


def cache_formats_markdown(result: dict[str, Any]) -> str:
    """Tables of the parts run: bytes per family and format, KL per family and format, load and TTFT per format."""
    formats = list(result["formats"])
    lines = [f"# hypic-rag benchmark: cache formats ({result['config']['profile']})", "",
             f"Machine: {result['machine']}; load average {result['load_average_before'][0]:.1f} before, "
             f"{result['load_average_after'][0]:.1f} after (a shared machine: timings are noisy). "
             f"Command: `{result['command']}` ({result['seconds']:.0f} s).", "",
             "| format | transition | suffix_state | conv_tail | key_value |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| `{name}` | " + " | ".join(codings.values()) + " |" for name, codings in result["formats"].items()]
    if "bytes" in result:
        for dtype in result["config"]["model_dtypes"]:
            for length in result["config"]["chunk_lengths"]:
                rows = [row for row in result["bytes"] if row["model_dtype"] == dtype and row["chunk_tokens"] == length]
                lines += ["", f"## Bytes per {length}-token chunk, model in {dtype}: MiB (share of the float32 "
                          "format's)", "", "| family | " + " | ".join(formats) + " |",
                          "| --- |" + " --- |" * len(formats)]
                for row in rows:
                    cells = [f"{_mib(row['bytes'][name])}" + ("" if name == "float32" else
                                                             f" ({100 * row['ratio'][name]:.1f}%)") for name in formats]
                    lines.append(f"| `{row['model_type']}` | " + " | ".join(cells) + " |")
    if "quality" in result:
        compressed = [name for name in formats if name != DEFAULT_CACHE_FORMAT]
        lines += ["", "## KL(float32 entries || format entries) of `hypic`'s next-token distribution, tiny random "
                  "models: mean / p99", "", "| family | " + " | ".join(compressed) + " |",
                  "| --- |" + " --- |" * len(compressed)]
        for row in result["quality"]:
            cells = [f"{row['formats'][name]['mean_kl']:.1e} / {row['formats'][name]['p99_kl']:.1e}"
                     for name in compressed]
            lines.append(f"| `{row['model_type']}` | " + " | ".join(cells) + " |")
    if "load" in result:
        lines += ["", f"## Load time per entry ({result['config']['load_layers']}-layer Qwen3.5-35B-A3B shapes, "
                  "256 tokens, medians)", "", "| format | value | disk cold (read + crc32) | disk warm | decode to "
                  "float32 |", "| --- | --- | --- | --- | --- |"]
        for row in result["load"]:
            lines.append(f"| `{row['cache_format']}` | {_mib(row['value_bytes'])} MiB | {row['disk_cold_ms']} ms | "
                         f"{row['disk_warm_ms']} ms | {row['decode_ms']} ms |")
    if "ttft" in result:
        ttft = result["ttft"]
        lines += ["", f"## `hypic` time to first token from an LMDB cache ({ttft['model']} timing model, "
                  f"{ttft['parameters'] / 1e6:.0f}M parameters, {ttft['chunks']} x {ttft['chunk_tokens']}-token chunks, "
                  f"{ttft['prompt_tokens']} prompt tokens, {ttft['threads']} threads, medians of {ttft['requests']})",
                  "", "| format | warm | x float32 | cold | x float32 | load warm | load cold | KL vs float32 |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for row in ttft["rows"]:
            lines.append(f"| `{row['cache_format']}` | {row['warm_ms']} ms | {row['warm_vs_float32']:.2f} | "
                         f"{row['cold_ms']} ms | {row['cold_vs_float32']:.2f} | {row['load_warm_ms']} ms | "
                         f"{row['load_cold_ms']} ms | {row['kl_vs_float32']:.1e} |")
    return "\n".join(lines) + "\n"


def write_cache_formats(result: dict[str, Any], directory: Path) -> list[Path]:
    """`cache_formats.json` and `cache_formats.md` (`cache_formats_<profile>.*` for another profile)."""
    from hypic_rag.bench.report import write_json_and_markdown

    profile = result["config"]["profile"]
    stem = "cache_formats" if profile == "standard" else f"cache_formats_{profile}"
    return write_json_and_markdown(result, directory, stem, cache_formats_markdown(result))
