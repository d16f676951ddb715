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
    layout_reason,
    weight_bytes,
    worker_threads,
)


@pytest.mark.parametrize(("cores", "size", "device", "expected"), [
    (2, 9 << 20, "cpu", 2),  # the bundled model, 2 cores: one worker per core (writable or not)
    (16, 9 << 20, "cpu", MAX_AUTO_WORKERS),  # capped
    (1, 9 << 20, "cpu", 1),  # one core: nothing to share out
    (2, SMALL_MODEL_BYTES + 1, "cpu", 1),  # a larger model: one process, every core's threads
    (2, SMALL_MODEL_BYTES, "cpu", 2),
    (8, 9 << 20, "cuda", 1),  # on a GPU one process per device
])
def test_auto_workers_rule(cores: int, size: int, device: str, expected: int) -> None:
    assert auto_workers(cores, size, device=device) == expected


def test_the_bundled_model_is_small_and_auto_shares_the_cores_out() -> None:
    size = weight_bytes(default_model_path())
    assert 0 < size <= SMALL_MODEL_BYTES
    chosen = auto_workers(2, size, device="cpu")
    assert chosen == 2 and worker_threads(chosen, cores=2) == 1


def test_the_log_line_says_what_was_chosen_and_why() -> None:
    small = layout_reason(2, 1, 2, 9 << 20, "cpu", chosen=True)
    assert small.startswith("2 worker processes x 1 intra-op thread (2 cores") and "Python-bound" in small
    large = layout_reason(1, 16, 16, 2 << 30, "cpu", chosen=True)
    assert large.startswith("1 worker process x 16 intra-op threads") and "matrix-bound" in large
    assert "set by --workers / --threads" in layout_reason(3, 2, 2, 9 << 20, "cpu", chosen=False)


def test_workers_option_reads_auto_or_a_count() -> None:
    assert worker_count_or_auto("auto") == AUTO and worker_count_or_auto("AUTO") == AUTO
    assert worker_count_or_auto("3") == 3
    with pytest.raises(Exception, match="1..256"):
        worker_count_or_auto("0")
