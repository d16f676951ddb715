"""`serve --workers auto`: the rule choosing the model processes (`auto_workers`), and its resolution on the real
bundled model's checkpoint."""

from __future__ import annotations

import pytest

from hypic_rag.cli.serve_command import AUTO, worker_count_or_auto
from hypic_rag.demo.default_model import default_model_path
from hypic_rag.distributed.local_workers import (
    MAX_AUTO_WORKERS,
    SMALL_MODEL_BYTES,
    auto_workers,
    weight_bytes,
    worker_threads,
)


@pytest.mark.parametrize(("cores", "size", "read_only", "device", "expected"), [
    (2, 9 << 20, True, "cpu", 2),  # the bundled model, read-only, 2 cores: one worker per core
    (16, 9 << 20, True, "cpu", MAX_AUTO_WORKERS),  # capped
    (2, 9 << 20, False, "cpu", 1),  # a writable index keeps its document endpoints
    (1, 9 << 20, True, "cpu", 1),  # one core: nothing to share out
    (2, SMALL_MODEL_BYTES + 1, True, "cpu", 1),  # a larger model: one process, every core's threads
    (2, SMALL_MODEL_BYTES, True, "cpu", 2),
    (8, 9 << 20, True, "cuda", 1),  # on a GPU one process per device
])
def test_auto_workers_rule(cores: int, size: int, read_only: bool, device: str, expected: int) -> None:
    assert auto_workers(cores, size, read_only=read_only, device=device) == expected


def test_the_bundled_model_is_small_and_auto_shares_the_cores_out() -> None:
    size = weight_bytes(default_model_path())
    assert 0 < size <= SMALL_MODEL_BYTES
    chosen = auto_workers(2, size, read_only=True, device="cpu")
    assert chosen == 2 and worker_threads(chosen, cores=2) == 1


def test_workers_option_reads_auto_or_a_count() -> None:
    assert worker_count_or_auto("auto") == AUTO and worker_count_or_auto("AUTO") == AUTO
    assert worker_count_or_auto("3") == 3
    with pytest.raises(Exception, match="1..256"):
        worker_count_or_auto("0")
