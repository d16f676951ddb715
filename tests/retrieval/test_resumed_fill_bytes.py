"""A fill stopped after its first write and run again stores the bytes an uninterrupted fill stores: batches are
planned over every planned segment and each batch holding a missing one runs whole (an entry's bytes depend on
its batch's padded shape). Without that, the resumed fill would batch the remaining segments differently."""

from __future__ import annotations

import random
from pathlib import Path

from hypic_rag.cache.lmdb_store import LmdbSegmentStore
from hypic_rag.runtime.model import load_model
from hypic_rag.pipeline.session import ModelSession


def contents(directory: Path) -> dict[bytes, bytes]:
    with LmdbSegmentStore.open(directory, readonly=True) as store:
        return {key: bytes(store.get(key, touch=False)) for key in store.keys()}


def test_a_resumed_fill_stores_the_bytes_of_an_uninterrupted_one(tiny_model: Path, tmp_path: Path) -> None:
    model = load_model(tiny_model, device="cpu", require_tokenizer=True)
    rng = random.Random(0)
    segments = [[rng.randrange(3, 200) for _ in range(rng.randint(6, 60))] for _ in range(40)]
    reports = {}
    for name, stop_after in (("whole", None), ("resumed", 3)):
        with ModelSession.of_model(model, seam_tokens=4, cache_dir=tmp_path / name) as session:
            session.engine.encode_batch_tokens = 256  # several batches of several segments each
            plans = session.plan(segments)
            if stop_after is not None:
                steps = session.fill_steps(plans, commit_entries=3)  # a write splits a batch
                for report in steps:
                    if report.encoded >= stop_after:
                        break
                steps.close()  # stopped after its first write, as a killed run
            reports[name] = session.fill_cache(plans)
    stored_before = reports["whole"].to_encode - reports["resumed"].to_encode
    assert 3 <= stored_before < reports["whole"].to_encode  # the resumed fill had work left
    whole, resumed = contents(tmp_path / "whole"), contents(tmp_path / "resumed")
    assert whole.keys() == resumed.keys() and len(whole) == reports["whole"].to_encode
    assert all(whole[key] == resumed[key] for key in whole)
