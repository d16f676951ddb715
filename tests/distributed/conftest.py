"""The one Ray instance of the test run, shared by every test file here: a local cluster of 2 CPU slots, started
on first use and shut down at the end; and one local S3-compatible server (moto) for the remote tier. Without Ray
installed, every test that asks for the cluster is skipped (as is every remote-tier test without moto).

Network: everything listens on 127.0.0.1 only. Ray turns a node address of 127.0.0.1 (`ray.init(
_node_ip_address=...)`, `ray start --node-ip-address`) into the machine's routable address, and its servers then
listen on every interface, unless `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` is set before Ray is imported: Ray then
runs as a single-machine instance whose node address is 127.0.0.1, and every server it starts (GCS, raylet, object
manager, workers, dashboard agent, runtime-env agent) binds that address. It is set here, before anything imports
Ray, and inherited by the subprocesses the tests start (`serve --ray ADDRESS`, `precompute --ray ADDRESS`);
`test_cluster_binding.py` checks every listening socket of the cluster's processes.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported: loopback only

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """`ray`, initialised on a local 2-CPU cluster whose workers import this checkout. The cluster's processes
    hold the local S3 server's test credentials in their environment, as a real node holds its own (variables
    set where `ray start` ran, a profile, an instance role): replicas and actors build their S3 clients from it."""
    from kits.s3 import aws_test_environment

    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'hypic-rag[ray]')")
    env_vars = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with aws_test_environment():  # the raylet (and so every worker it starts) inherits these; restored after
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


@pytest.fixture(scope="session")
def local_s3() -> Iterator[Any]:
    """A `kits.s3.LocalS3` (moto) on 127.0.0.1 for the session; skipped without moto or boto3."""
    pytest.importorskip("boto3", reason="boto3 is not installed (pip install 'hypic-rag[remote]')")
    pytest.importorskip("moto.server", reason="moto is not installed (the test extra)")
    from kits.s3 import LocalS3

    server = LocalS3()
    try:
        yield server
    finally:
        server.stop()


def _listening_inodes() -> dict[int, str]:
    """Socket inode -> "address:port" of every TCP socket listening on this machine (from /proc/net/tcp{,6})."""
    found: dict[int, str] = {}
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # little-endian 32-bit words
            text = ".".join(str(b) for b in words) if width == 8 else (
                "::ffff:" + ".".join(str(b) for b in words[12:]) if words[:12] == b"\0" * 10 + b"\xff\xff"
                else ":".join(words[i:i + 2].hex() for i in range(0, 16, 2)))
            found[int(fields[9])] = f"{text}:{int(port, 16)}"
    return found


def _family(root: int) -> set[int]:
    """`root` and every process descended from it."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    family, grew = {root}, True
    while grew:
        grown = family | {pid for pid, parent in parents.items() if parent in family}
        grew, family = grown != family, grown
    return family


def _listening_addresses(root: int, marker: str | None = None) -> dict[str, list[str]]:
    """"address:port" -> the processes listening there, over `root`, its descendants and (when `marker` is
    given) every process whose command line contains it (Ray daemons that were re-parented)."""
    pids = _family(root)
    if marker:
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and marker in (entry / "cmdline").read_text(errors="replace"):
                    pids.add(int(entry.name))
            except OSError:
                continue
    inodes = _listening_inodes()
    found: dict[str, list[str]] = {}
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and int(target[8:-1]) in inodes:
                found.setdefault(inodes[int(target[8:-1])], []).append(f"{name}[{pid}]")
    return found


@pytest.fixture(scope="session")
def process_family() -> Any:
    """A function: root pid -> {pid: command line} of `root`'s descendants (read from /proc; the root excluded)."""

    def family(root: int) -> dict[int, str]:
        found = {}
        for pid in _family(root) - {root}:
            try:
                found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
        return found

    return family


@pytest.fixture(scope="session")
def beyond_loopback() -> Any:
    """A function (root pid, marker=None) -> (every "address:port" listened on by `root`, its descendants and the
    processes whose command line holds `marker`; those of them not on 127.0.0.1, with their processes)."""

    def check(root: int, marker: str | None = None) -> tuple[list[str], dict[str, list[str]]]:
        addresses = _listening_addresses(root, marker)
        return sorted(addresses), {address: owners for address, owners in addresses.items()
                                   if not address.startswith(("127.0.0.1:", "::ffff:127.0.0.1:"))}

    return check
