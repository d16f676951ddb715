"""The runtime's Engine on a persistent SegmentCache: a restart in another process serves hits with the same
logits as a fresh encode; a damaged entry is reported by `cache verify`, recomputed, and the answer stays right."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hypic_rag.cache.keys import CacheNamespace, segment_key
from hypic_rag.cache.segment_cache import SegmentCache
from hypic_rag.cache.synthetic import HybridShape, synthetic_entry
from hypic_rag.cli.main import main as cli_main
from hypic_rag.entry.schema import ATTENTION_LAYER, ATTENTION_PARTS, entry_bytes, is_kv_name, tensor_name
from hypic_rag.runtime.engine import Engine, Request
from hypic_rag.runtime.model import wrap_model
from hypic_rag.runtime.segment_source import MemorySegmentSource, SegmentSource
from hypic_rag.testing import build_tiny_model

SEED = 11
SEAM = 4
MIB = 1 << 20


def namespace_of(model) -> CacheNamespace:
    """The namespace the engine's entries of `model` are keyed by (seam `SEAM`, float32 state)."""
    return CacheNamespace.for_model(model, SEAM)


def make_request() -> Request:
    generator = torch.Generator().manual_seed(5)

    def ids(n: int) -> list[int]:
        return torch.randint(0, 256, (n,), generator=generator).tolist()

    return Request(prefix_ids=ids(6), chunk_ids=[ids(n) for n in (24, 40, 17)], question_ids=ids(7))


@pytest.fixture(scope="module")
def model():
    return wrap_model(build_tiny_model("qwen3_5", seed=SEED))


@pytest.fixture(scope="module")
def reference_logits(model) -> torch.Tensor:
    """hypic logits without any persistent cache (the in-process path)."""
    return Engine(model, seam_tokens=SEAM).prefill(make_request(), mode="hypic").logits


RESTARTED_PROCESS = """
    import sys, torch
    from hypic_rag.cache.keys import CacheNamespace
    from hypic_rag.cache.segment_cache import SegmentCache
    from hypic_rag.runtime.engine import Engine, Request
    from hypic_rag.runtime.model import wrap_model
    from hypic_rag.testing import build_tiny_model
    cache_dir, out_path, seed, seam = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    request = torch.load(sys.argv[5])
    model = wrap_model(build_tiny_model("qwen3_5", seed=seed))
    with SegmentCache.open(cache_dir, namespace=CacheNamespace.for_model(model, seam)) as cache:
        result = Engine(model, seam_tokens=seam, segment_source=cache).prefill(Request(**request), mode="hypic")
        torch.save({"logits": result.logits, "hits": result.stats.cache_hits, "misses": result.stats.cache_misses,
                    "disk_hits": cache.stats()["disk_hits"]}, out_path)
"""


def test_a_restarted_process_hits_and_gives_the_same_logits_as_a_fresh_encode(
    tmp_path: Path, model, reference_logits: torch.Tensor
) -> None:
    request = make_request()
    cache_dir = tmp_path / "cache"
    with SegmentCache.open(cache_dir, disk_budget_bytes=256 * MIB, namespace=namespace_of(model)) as cache:
        fresh = Engine(model, seam_tokens=SEAM, segment_source=cache).prefill(request, mode="hypic")
        assert fresh.stats.cache_misses == len(request.segments) and fresh.stats.cache_hits == 0
    assert torch.equal(fresh.logits, reference_logits)

    request_file, out_file, script = tmp_path / "request.pt", tmp_path / "out.pt", tmp_path / "restarted.py"
    torch.save({"prefix_ids": request.prefix_ids, "chunk_ids": request.chunk_ids,
                "question_ids": request.question_ids}, request_file)
    script.write_text(textwrap.dedent(RESTARTED_PROCESS))
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1")
    completed = subprocess.run(
        [sys.executable, str(script), str(cache_dir), str(out_file), str(SEED), str(SEAM), str(request_file)],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    restarted = torch.load(out_file)
    assert restarted["hits"] == len(request.segments) and restarted["misses"] == 0
    assert restarted["disk_hits"] == len(request.segments)
    assert torch.equal(restarted["logits"], fresh.logits)  # bit-identical


def test_a_damaged_entry_is_reported_recomputed_and_the_answer_stays_right(
    tmp_path: Path, model, reference_logits: torch.Tensor, capsys
) -> None:
    request = make_request()
    cache_dir = tmp_path / "cache"
    engine_namespace = namespace_of(model)
    with SegmentCache.open(cache_dir, disk_budget_bytes=256 * MIB, namespace=engine_namespace) as cache:
        Engine(model, seam_tokens=SEAM, segment_source=cache).prefill(request, mode="hypic")
        damaged_key = segment_key(engine_namespace, request.chunk_ids[1])
        stored = bytes(cache.store.get(damaged_key, touch=False))
    data_file = cache_dir / "data.mdb"
    data = bytearray(data_file.read_bytes())
    start = data.find(stored[:256])
    assert start >= 0
    data[start + len(stored) // 2] ^= 0x01  # one flipped bit in the middle of the stored linear state
    data_file.write_bytes(bytes(data))

    assert cli_main(["cache", "verify", "--cache", str(cache_dir)]) == 1
    report = capsys.readouterr().out
    assert damaged_key.hex() in report and "corrupt" in report and "1 bad" in report

    with SegmentCache.open(cache_dir, namespace=engine_namespace) as cache:
        result = Engine(model, seam_tokens=SEAM, segment_source=cache).prefill(request, mode="hypic")
        assert result.stats.cache_misses == 1 and result.stats.cache_hits == len(request.segments) - 1
        assert torch.equal(result.logits, reference_logits)
        assert cache.stats()["corrupt"] == 1
    assert cli_main(["cache", "verify", "--cache", str(cache_dir)]) == 0  # the entry was replaced by a good one


def test_another_model_never_gets_this_models_entries(tmp_path: Path, model, reference_logits: torch.Tensor) -> None:
    request = make_request()
    other = wrap_model(build_tiny_model("qwen3_5", seed=SEED + 1))
    assert other.fingerprint != model.fingerprint
    with SegmentCache.open(tmp_path, disk_budget_bytes=256 * MIB, namespace=namespace_of(model)) as cache:
        Engine(model, seam_tokens=SEAM, segment_source=cache).prefill(request, mode="hypic")
        with pytest.raises(ValueError, match="bound to model"):  # a cache bound to one model is refused by another
            Engine(other, seam_tokens=SEAM, segment_source=cache)
        seam_changed = Engine(model, seam_tokens=SEAM + 2, segment_source=cache).prefill(request, mode="hypic")
        # only the prefix's seam-independent (seam 0) entry is shared; every chunk entry is keyed by its seam
        assert seam_changed.stats.cache_hits == (1 if request.prefix_ids else 0)
        assert seam_changed.stats.cache_misses == len(request.chunk_ids)
    with SegmentCache.open(tmp_path, disk_budget_bytes=256 * MIB, namespace=namespace_of(other)) as cache:
        result = Engine(other, seam_tokens=SEAM, segment_source=cache).prefill(request, mode="hypic")
        assert result.stats.cache_hits == 0
    expected = Engine(other, seam_tokens=SEAM).prefill(request, mode="hypic").logits
    assert torch.equal(result.logits, expected) and not torch.equal(result.logits, reference_logits)


def test_the_engine_takes_a_segment_source_the_cache_and_the_memory_source_are_two(
    tmp_path: Path, model, reference_logits: torch.Tensor
) -> None:
    """The runtime sees a `SegmentSource`; a `SegmentCache` bound to the model's namespace is one and serves the
    same entries as the in-memory one; a cache without a namespace, or another model's, is refused."""
    request = make_request()
    memory = Engine(model, seam_tokens=SEAM)
    assert isinstance(memory.segment_source, MemorySegmentSource)
    assert isinstance(memory.segment_source, SegmentSource)
    memory.prefill(request, mode="hypic")
    with SegmentCache.open(tmp_path / "unbound") as unbound:
        with pytest.raises(ValueError, match="without a namespace"):
            Engine(model, seam_tokens=SEAM, segment_source=unbound)
    with SegmentCache.open(tmp_path / "cache", namespace=namespace_of(model)) as cache:
        assert isinstance(cache, SegmentSource)
        chunks = request.chunk_ids
        assert cache.missing_segments(chunks, SEAM) == chunks and cache.stored_bytes(namespace_of(model), chunks) == 0
        result = Engine(model, seam_tokens=SEAM, segment_source=cache).prefill(request, mode="hypic")
        assert torch.equal(result.logits, reference_logits)
        assert cache.missing_segments(chunks, SEAM) == [] and cache.missing_segments(chunks, SEAM + 1) == chunks
        assert cache.contains_many(namespace_of(model), chunks) == [True] * len(chunks)
        assert cache.stored_bytes(namespace_of(model), chunks) >= sum(
            entry_bytes(memory.encode_segment(ids)).tensor_bytes for ids in chunks
        )  # the encoded values (float32 state, uncompressed) hold every tensor of the entries
        for ids in chunks:  # what the cache hands back is what the memory source holds for the same segment
            entries, hits = cache.get_or_encode_segments([ids], SEAM, lambda missing: [])
            memory_entries, memory_hits = memory.segment_source.get_or_encode_segments([ids], SEAM, lambda m: [])
            assert hits == memory_hits == [True]
            assert entries[0].keys() == memory_entries[0].keys()
            assert all(torch.equal(entries[0][name], memory_entries[0][name]) for name in entries[0])
    other = wrap_model(build_tiny_model("qwen3_5", seed=SEED + 1))
    with pytest.raises(ValueError, match="another model"):
        Engine(other, seam_tokens=SEAM, segment_source=memory.segment_source)


def test_synthetic_entries_have_the_names_and_shapes_the_runtime_encodes(model) -> None:
    """The cache's synthetic entries and the runtime's encoder spell the entry format from the same module."""
    ids = list(range(5, 26))
    encoded = Engine(model, seam_tokens=SEAM).encode_segment(ids)
    synthetic = synthetic_entry(HybridShape.from_config(model.hf_model.config), ids, seam_tokens=SEAM)
    assert {name: (tuple(t.shape), t.dtype) for name, t in synthetic.items()} == {
        name: (tuple(t.shape), t.dtype) for name, t in encoded.items()
    }
    assert entry_bytes(synthetic) == entry_bytes(encoded)
    assert {name for name in encoded if is_kv_name(name)} == {
        tensor_name(index, part)
        for index, kind in enumerate(model.layer_types) if kind == ATTENTION_LAYER for part in ATTENTION_PARTS
    }


@pytest.mark.parametrize("cache_format", ["int8", "int4"])
def test_compressed_entries_answer_alike_on_a_miss_and_a_hit_alone_and_batched(
    tmp_path: Path, model, reference_logits: torch.Tensor, cache_format: str
) -> None:
    """The engine decodes a compressed cache's stored form once per hit; a miss (encoded by the engine, or by the
    scheduler for a batch) gives the logits a later hit gives, bit for bit, and they stay near float32 entries'."""
    from hypic_rag.entry.compression import is_compressed
    from hypic_rag.runtime.sampling import SamplingParams
    from hypic_rag.runtime.scheduler import QueueSink, Scheduler

    namespace = CacheNamespace.for_model(model, SEAM, cache_format)
    request = make_request()
    params = SamplingParams(max_new_tokens=3, logprobs=1)
    with SegmentCache.open(tmp_path / "alone", namespace=namespace) as cache:
        engine = Engine(model, seam_tokens=SEAM, segment_source=cache)
        miss = engine.prefill(request, "hypic")
        hit = engine.prefill(request, "hypic")
        entry = cache.get(namespace, request.chunk_ids[0])
        assert entry is not None and is_compressed(entry)  # the hot tier and the disk hold the stored form
        alone = engine.generate(request, "hypic", params)
    assert miss.stats.cache_misses == 4 and hit.stats.cache_hits == 4
    assert torch.equal(miss.logits, hit.logits)
    from hypic_rag.runtime.quality import kl_divergence

    assert kl_divergence(reference_logits, hit.logits) < (1e-5 if cache_format == "int8" else 1e-3)
    with SegmentCache.open(tmp_path / "batched", namespace=namespace) as cache:
        scheduler = Scheduler(Engine(model, seam_tokens=SEAM, segment_source=cache))
        sink = QueueSink()
        scheduler.submit(request, "hypic", params, sink=sink)  # cold: the scheduler encodes the misses itself
        while scheduler.has_work:
            scheduler.step()
        batched = sink.future.result(timeout=0)
    assert batched.token_ids == alone.token_ids
    for mine, theirs in zip(batched.logprobs, alone.logprobs, strict=True):
        assert mine.token_id == theirs.token_id and abs(mine.logprob - theirs.logprob) < 1e-5
