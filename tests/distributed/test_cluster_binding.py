"""The session's Ray cluster listens on 127.0.0.1 only (see conftest.py): every TCP socket that this process, the
cluster's processes (GCS, raylet, workers, agents) and their children listen on is bound to the loopback address,
and the cluster's address is a loopback one."""

from __future__ import annotations

import os
from typing import Any

import pytest


def test_the_test_cluster_listens_on_loopback_only(ray_cluster: Any, ray_address: str, beyond_loopback: Any) -> None:
    @ray_cluster.remote
    def where() -> int:
        return os.getpid()

    assert ray_cluster.get(where.remote()) > 0  # a worker is up (and listening) too
    assert ray_address.startswith("127.0.0.1:")
    session = os.path.basename(ray_cluster._private.worker._global_node.get_session_dir_path())
    addresses, elsewhere = beyond_loopback(os.getpid(), marker=session)
    assert len(addresses) >= 4, addresses  # gcs, raylet, this driver, a worker at least
    assert elsewhere == {}, f"listening beyond 127.0.0.1: {elsewhere}"


def test_a_private_instance_listens_on_loopback_only() -> None:
    """`--ray` without an address (`connect("local")`) starts a private instance bound to 127.0.0.1, with nothing
    in the environment asking for it."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("ray", reason="ray is not installed")
    code = ("from hypic_rag.distributed.cluster import ClusterConfig, connect, disconnect_if_local\n"
            "options = ClusterConfig(address='local', num_cpus=1)\n"
            "ray = connect(options)\n"
            "print(ray.get_runtime_context().gcs_address)\n"
            "disconnect_if_local(ray, options)\n")
    env = {name: value for name, value in os.environ.items() if name != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env,
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1].startswith("127.0.0.1:"), result.stdout
