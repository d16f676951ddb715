"""A compressed cache entry whose bytes are intact (crc32 valid) but decode to NaN or infinity is corrupt: the codec
refuses it, `hypic-rag cache verify` flags it, and `ask` recomputes it (counted) and answers as with a clean cache.
Real index (tiny model, int8 entries in a real LMDB cache, FAISS); the command line's `main` runs in this process."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
import torch

from hypic_rag.cache.codec import decode_entry, encode_entry, read_header
from hypic_rag.cache.errors import CorruptEntryError
from hypic_rag.cache.lmdb_store import LmdbSegmentStore
from hypic_rag.cache.store import PutRequest
from hypic_rag.entry.compression import compress_entry
from cli_support import run_here  # tests/cli/cli_support.py

BFLOAT16_BITS = {"nan": 0x7FC0, "inf": 0x7F80}
QUESTION = "Who keeps bees?"


def with_scale(value: bytearray, bits: int) -> bytearray:
    """`value` (an encoded entry) with the first group scale of its first coded tensor set to the bfloat16 `bits`,
    and its crc32 made valid again."""
    damaged = bytearray(value)
    _, specs = read_header(damaged)
    scale = next(spec for spec in specs if spec.name.endswith("#scale") and spec.dtype == "bfloat16")
    struct.pack_into("<H", damaged, scale.offset, bits)
    struct.pack_into("<I", damaged, 12, zlib.crc32(memoryview(damaged)[16:]))
    read_header(damaged)  # the crc32 holds: only decoding to values can tell
    return damaged


@pytest.mark.parametrize("coding", ["int8", "int4", "fp8"])
def test_the_codec_refuses_stored_forms_that_decode_to_nan_or_infinity(coding: str) -> None:
    generator = torch.Generator().manual_seed(0)
    entry = {"layer0.linear.suffix_state": torch.randn(2, 16, 32, generator=generator),
             "layer1.attention.key": torch.randn(2, 6, 32, generator=generator),
             "token_ids": torch.arange(6)}
    value = encode_entry(compress_entry(entry, coding), "namespace")
    decode_entry(bytearray(value))  # the intact value decodes
    for name, bits in BFLOAT16_BITS.items():
        with pytest.raises(CorruptEntryError, match="NaN or an infinity"):
            decode_entry(with_scale(value, bits))
    huge = with_scale(value, 0x7F7F)  # the largest finite bfloat16: a code times it overflows float32
    with pytest.raises(CorruptEntryError, match="past float32's range"):
        decode_entry(huge)
    if coding == "fp8":  # e4m3fn's NaN code
        _, specs = read_header(value)
        codes = next(spec for spec in specs if spec.name.endswith("#fp8"))
        damaged = bytearray(value)
        damaged[codes.offset] = 0x7F
        struct.pack_into("<I", damaged, 12, zlib.crc32(memoryview(damaged)[16:]))
        with pytest.raises(CorruptEntryError, match="float8 NaN code"):
            decode_entry(damaged)


@pytest.fixture(scope="module")
def int8_index(tmp_path_factory: pytest.TempPathFactory, copy_tiny_index, tiny_model: Path) -> Path:
    """A copy of the tiny index with its cache rebuilt in int8 (group scales in bfloat16)."""
    from hypic_rag.cli.in_process import run_cli_here
    from kits.corpora import SMALL_CORPUS, write_corpus

    base = tmp_path_factory.mktemp("nonfinite")
    index = copy_tiny_index(base / "index")
    corpus = write_corpus(base / "corpus", SMALL_CORPUS)
    done = run_cli_here("precompute", str(corpus), "--index", str(index), "--model", str(tiny_model), "--device",
                        "cpu", "--no-progress", "--chunk-tokens", "96", "--cache-format", "int8")
    assert done.returncode == 0, done.stderr
    return index


def ask(capsys: pytest.CaptureFixture[str], index: Path) -> dict:
    done = run_here(capsys, "ask", "--index", str(index), "--device", "cpu", "--top-k", "3", "--max-new-tokens", "6",
                    "--json", QUESTION)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_verify_flags_a_nan_scale_and_ask_recomputes_it(capsys: pytest.CaptureFixture[str], int8_index: Path) -> None:
    clean = ask(capsys, int8_index)
    assert clean["usage"]["cache_hits"] >= 3 and clean["usage"]["cache_misses"] == 0
    cache_dir = int8_index / "segment_cache"
    store = LmdbSegmentStore.open(cache_dir)
    try:
        keys = list(store.keys())
        for key in keys:  # every entry: whichever chunks the question retrieves are damaged
            damaged = with_scale(store.get(key, touch=False), BFLOAT16_BITS["nan"])
            store.remove(key)
            assert store.put(PutRequest(key, damaged))
        store.flush()
    finally:
        store.close()

    done = run_here(capsys, "cache", "verify", "--cache", str(cache_dir), "--json")
    assert done.returncode == 1, (done.stdout, done.stderr)
    report = json.loads(done.stdout)
    assert report["ok"] == 0 and len(report["problems"]) == len(keys)
    assert {problem["kind"] for problem in report["problems"]} == {"corrupt"}
    assert all("NaN or an infinity" in problem["reason"] for problem in report["problems"])

    answered = ask(capsys, int8_index)
    assert answered["usage"]["cache_misses"] >= 3 and answered["usage"]["cache_hits"] == 0  # recomputed
    assert answered["answer"] == clean["answer"] and answered["answer"] != ""
    stats = json.loads(run_here(capsys, "cache", "stats", "--cache", str(cache_dir), "--json").stdout)
    assert stats["corrupt"] == answered["usage"]["cache_misses"]
    again = ask(capsys, int8_index)  # the recomputed entries replaced the damaged ones
    assert again["usage"]["cache_misses"] == 0 and again["answer"] == clean["answer"]
