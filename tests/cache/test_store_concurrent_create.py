"""A new segment cache opened by several processes at the same moment (the workers of `serve` start together over
one index): every one opens it (was: 'an LMDB store but not a hypic-rag cache' or 'not empty and holds no cache'
for whichever saw the store half made), and the store is then one valid cache."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from hypic_rag.cache.lmdb_store import LmdbSegmentStore

PROCESSES = 4
ROUNDS = 12


def _open(path: str, barrier: object, results: object) -> None:
    barrier.wait()  # type: ignore[attr-defined]
    try:
        LmdbSegmentStore.open(path).close()
        results.put("ok")  # type: ignore[attr-defined]
    except Exception as error:  # noqa: BLE001 - reported to the test
        results.put(f"{type(error).__name__}: {error}")  # type: ignore[attr-defined]


def test_processes_creating_one_store_at_once_all_open_it(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    failures = []
    for round_number in range(ROUNDS):
        path = tmp_path / f"round-{round_number}" / "segment_cache"
        barrier, results = context.Barrier(PROCESSES), context.Queue()
        processes = [context.Process(target=_open, args=(str(path), barrier, results)) for _ in range(PROCESSES)]
        for process in processes:
            process.start()
        outcomes = [results.get(timeout=60) for _ in processes]
        for process in processes:
            process.join(60)
        failures += [outcome for outcome in outcomes if outcome != "ok"]
        with LmdbSegmentStore.open(path, readonly=True) as store:
            assert store.path == path
    assert not failures, failures
