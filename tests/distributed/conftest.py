"""The one Ray instance of the test run: a local cluster of 2 CPU slots, started on first use (by a distributed
test) and shut down at the end. Without Ray installed, every test that asks for it is skipped."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """`ray`, initialised on a local 2-CPU cluster whose workers import this checkout."""
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'hypic-rag[ray]')")
    env_vars = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": env_vars})
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def ray_address(ray_cluster: Any) -> str:
    """The GCS address of the session's cluster (for a driver in another process: `--ray ADDRESS`)."""
    return str(ray_cluster.get_runtime_context().gcs_address)
