"""The session's Ray cluster listens on 127.0.0.1 only (see conftest.py): every TCP socket that this process, the
cluster's processes (GCS, raylet, workers, agents) and their children listen on is bound to the loopback address,
and the cluster's address is a loopback one."""

from __future__ import annotations

import os
from typing import Any


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
