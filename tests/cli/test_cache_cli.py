"""`hypic-rag cache stats | verify | gc | clear`: outputs, exit codes, and one-line errors for bad input
(missing directory, a file that is not an LMDB store, a read-only directory), never a traceback."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hypic_rag.cache.keys import CacheNamespace, segment_key
from hypic_rag.cache.segment_cache import SegmentCache
from hypic_rag.cache.synthetic import TINY_SHAPE, synthetic_entry
from hypic_rag.cli.main import main

NS = CacheNamespace(model_fingerprint="m", tokenizer_fingerprint="t", seam_tokens=8)
CHUNKS = [list(range(start, start + 20)) for start in range(0, 100, 20)]
MIB = 1 << 20
HYPIC_RAG = str(Path(sys.executable).with_name("hypic-rag"))


def populate(directory: Path, budget: int = 64 * MIB) -> list[bytes]:
    with SegmentCache.open(directory, disk_budget_bytes=budget) as cache:
        assert cache.get_many(NS, CHUNKS) == [None] * len(CHUNKS)  # misses
        cache.put_many(NS, CHUNKS, [synthetic_entry(TINY_SHAPE, ids) for ids in CHUNKS])
        assert cache.get_many(NS, CHUNKS[:1])[0] is not None  # a hit
        return [segment_key(NS, ids) for ids in CHUNKS]


def damage(directory: Path, key: bytes) -> None:
    with SegmentCache.open(directory) as cache:
        stored = bytes(cache.store.get(key, touch=False))
    data = bytearray((directory / "data.mdb").read_bytes())
    data[data.find(stored[:256]) + len(stored) - 8] ^= 0xFF
    (directory / "data.mdb").write_bytes(bytes(data))


def test_stats_reports_entries_sizes_and_lookups(tmp_path: Path, capsys) -> None:
    populate(tmp_path)
    assert main(["cache", "stats", "--cache", str(tmp_path), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["entries"] == 5 and stats["hits"] == 1 and stats["misses"] == 5
    assert stats["kv_bytes_per_entry"] == 2 * 2 * 20 * 16 * 4
    assert stats["linear_bytes_per_entry"] == 3 * (2 * 4 * 16 * 16 * 4 + 128 * 3 * 4) + 8  # P, Z, conv tail + seam scalar
    assert main(["cache", "stats", "--cache", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "entries         5" in text and "1 hits, 5 misses" in text


def test_verify_gc_and_clear(tmp_path: Path, capsys) -> None:
    keys = populate(tmp_path)
    assert main(["cache", "verify", "--cache", str(tmp_path)]) == 0
    assert "checked 5 entries: 5 ok, 0 bad (1 namespaces)" in capsys.readouterr().out
    damage(tmp_path, keys[2])
    assert main(["cache", "verify", "--cache", str(tmp_path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [(p["key"], p["kind"]) for p in report["problems"]] == [(keys[2].hex(), "corrupt")]
    assert report["ok"] == 4
    entry_bytes = json.loads(_stats_json(tmp_path, capsys))["bytes_per_entry"]
    assert main(["cache", "gc", "--cache", str(tmp_path), "--budget", str(2 * entry_bytes + 100)]) == 0
    assert "removed 1 bad entries, evicted 2; 2 entries" in capsys.readouterr().out
    stats = json.loads(_stats_json(tmp_path, capsys))
    assert stats["corrupt"] == 1 and stats["evictions"] == 2 and stats["budget_bytes"] == 2 * entry_bytes + 100
    assert main(["cache", "verify", "--cache", str(tmp_path)]) == 0
    with SegmentCache.open(tmp_path) as cache:  # CHUNKS[0] was used last, so it survived the eviction
        assert cache.store.contains(keys[0]) and not cache.store.contains(keys[1])
    capsys.readouterr()
    assert main(["cache", "clear", "--cache", str(tmp_path)]) == 0
    assert "removed 2 entries" in capsys.readouterr().out
    assert json.loads(_stats_json(tmp_path, capsys))["entries"] == 0


def _stats_json(directory: Path, capsys) -> str:
    capsys.readouterr()
    assert main(["cache", "stats", "--cache", str(directory), "--json"]) == 0
    return capsys.readouterr().out


def assert_one_line_error(code: int, stderr: str, message: str) -> None:
    assert code == 2, stderr
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hypic-rag cache: error: ") and message in lines[0], lines


def test_bad_input_gives_one_clear_line_and_exit_code_2(tmp_path: Path, capsys) -> None:
    not_lmdb = tmp_path / "not_lmdb"
    not_lmdb.mkdir()
    (not_lmdb / "data.mdb").write_text("hello, not a database")
    a_file = tmp_path / "plain.txt"
    a_file.write_text("x")
    # the installed console script, as a user runs it
    completed = subprocess.run(
        [HYPIC_RAG, "cache", "stats", "--cache", str(tmp_path / "missing")],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert_one_line_error(completed.returncode, completed.stderr, "no cache directory")
    for argv, message in [
        (["verify", "--cache", str(not_lmdb)], "is not an LMDB store"),
        (["gc", "--cache", str(a_file)], "is not a directory"),
        (["clear", "--cache", str(tmp_path)], "holds no cache"),
    ]:
        code = main(["cache", *argv])
        assert_one_line_error(code, capsys.readouterr().err, message)
    with pytest.raises(SystemExit) as usage:
        main(["cache", "gc", "--cache", str(tmp_path), "--budget", "lots"])
    assert usage.value.code == 2 and "not a positive size" in capsys.readouterr().err


def _drop_dac_override() -> None:
    """In the child, before exec: drop root's permission-bypass capabilities so modes apply as to any user."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


READ_ONLY_DIR_CHECKS = """
import json, sys
from hypic_rag.cache.errors import CacheOpenError
from hypic_rag.cache.segment_cache import SegmentCache
from hypic_rag.cli.main import main
print("GC", main(["cache", "gc", "--cache", sys.argv[1]]), flush=True)
print("STATS", main(["cache", "stats", "--cache", sys.argv[1], "--json"]), flush=True)
try:
    SegmentCache.open(sys.argv[1])
except CacheOpenError as error:
    print("OPEN_ERROR", error)
with SegmentCache.open(sys.argv[1], readonly=True) as cache:
    print("READ_ONLY_ENTRIES", cache.stats()["entries"])
"""


def test_a_read_only_directory_reads_but_refuses_writes_in_one_line(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    directory = shared / "cache"
    populate(directory)
    tmp_path.chmod(0o755)
    shared.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    directory.chmod(0o555)
    try:
        completed = subprocess.run(
            [sys.executable, "-c", READ_ONLY_DIR_CHECKS, str(directory)], capture_output=True, text=True,
            timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"),
            preexec_fn=_drop_dac_override if os.geteuid() == 0 else None,  # root ignores modes otherwise
        )
        assert completed.returncode == 0, completed.stderr
        gc_code, stats_json, stats_code, open_error, read_only_entries = completed.stdout.splitlines()
        assert gc_code == "GC 2"
        assert_one_line_error(2, completed.stderr, "cannot write to")  # gc's line is all there is on stderr
        assert stats_code == "STATS 0" and json.loads(stats_json)["entries"] == 5  # reading still works
        assert open_error.startswith("OPEN_ERROR cannot write to") and "read-only" in open_error
        assert read_only_entries == "READ_ONLY_ENTRIES 5"
    finally:
        directory.chmod(0o755)
        shutil.rmtree(shared, ignore_errors=True)
