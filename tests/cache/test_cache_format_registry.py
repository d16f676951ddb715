"""A new cache format is one `register_cache_format` (a line of `entry_storage/formats.py` for a built-in one):
registered here, a toy format codes and decodes entries, and `--cache-format`, `hypic-rag cache formats`, the
service's config, a cache namespace and format calibration's candidates all take it, with nothing else changed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hypic_rag.cache.keys import CacheNamespace
from hypic_rag.cache.synthetic import TINY_SHAPE, synthetic_entry
from hypic_rag.entry.compression import (
    CACHE_FORMATS,
    CacheFormat,
    TensorCoding,
    cache_format,
    compress_entry,
    decompress_entry,
    register_cache_format,
)

TOY = CacheFormat("int5-kv8", transition=TensorCoding("int5/64", fallback="float32"),
                  suffix_state=TensorCoding("int5/64"), conv_tail=TensorCoding("int8/128", transpose=True),
                  key_value=TensorCoding("int8/128+cols"), summary="P and Z as int5; K/V in 8 bits, columns evened out")


@pytest.fixture
def toy() -> Iterator[CacheFormat]:
    assert TOY.name not in CACHE_FORMATS
    register_cache_format(TOY)
    try:
        yield TOY
    finally:
        CACHE_FORMATS.pop(TOY.name)


def test_a_registered_format_codes_and_decodes_entries(toy: CacheFormat) -> None:
    assert cache_format("int5-kv8") is toy
    entry = synthetic_entry(TINY_SHAPE, list(range(40)), seed=3)
    stored = compress_entry(entry, "int5-kv8")
    assert any(name.endswith("#int5") for name in stored) and any(name.endswith("#columns") for name in stored)
    decoded = decompress_entry(stored)
    assert decoded.keys() == entry.keys()
    for name, tensor in entry.items():
        if tensor.is_floating_point():
            torch.testing.assert_close(decoded[name].float(), tensor.float(), rtol=0.1, atol=0.2 * float(
                tensor.abs().max()))


def test_every_reader_of_the_registry_takes_it(toy: CacheFormat, tmp_path: Path, capsys) -> None:
    from hypic_rag.cli.common import cache_format_name
    from hypic_rag.cli.main import main
    from hypic_rag.calibration.cache_format import format_candidates
    from hypic_rag.server.config import ServerConfig

    assert cache_format_name("int5-kv8") == "int5-kv8"
    assert "int5-kv8" in format_candidates()
    assert ServerConfig(index_dir=tmp_path, cache_format="int5-kv8").cache_format == "int5-kv8"
    assert CacheNamespace("model", "tokenizer", 4, cache_format="int5-kv8").storage_format is toy
    capsys.readouterr()
    assert main(["cache", "formats", "--json"]) == 0
    listed = {row["name"]: row for row in json.loads(capsys.readouterr().out)["formats"]}
    assert listed["int5-kv8"]["summary"] == toy.summary


def test_a_name_is_registered_once(toy: CacheFormat) -> None:
    register_cache_format(TOY)  # the same format again: nothing changes
    with pytest.raises(ValueError, match="registered already"):
        register_cache_format(CacheFormat("int5-kv8", *(TensorCoding("float16") for _ in range(4))))
