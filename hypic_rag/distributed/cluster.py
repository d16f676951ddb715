"""Connecting to a Ray cluster, and how many encoders it can hold.

    ray = connect("local")             # start a private Ray instance on this machine (ended with this process)
    ray = connect("auto")              # the cluster `ray start --head` runs on this machine
    ray = connect("10.0.0.5:6379")     # a cluster's GCS address (or ray://host:10001 through Ray Client)
    slots = encoder_slots(ray, device="cuda")   # one encoder per GPU (or per CPU slot on CPU)

`ray_module()` is the only place that imports Ray; without it installed, every `--ray` option fails with one line
(`RayUnavailableError`, exit 2) naming the extra to install. Nothing calls it unless `--ray` (or `--replicas` above
1) was given, so the single-machine paths never load Ray.

Every node must have hypic-rag installed and see the same model, embedder and corpus paths (a shared file system,
or the same copy on each node): actors load the model from the path the driver names and check its fingerprint.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any

from hypic_rag.errors import EXIT_BAD_INPUT, HypicError

logger = logging.getLogger(__name__)

LOCAL = "local"
"""`--ray` without an address: start a Ray instance in this process (it ends with the process)."""
LOOPBACK_ONLY_VARIABLE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Set to "0" before Ray is imported, Ray runs as a single-machine instance: node address 127.0.0.1, every server
it starts bound to it. Without it, Ray replaces a node address of 127.0.0.1 by the machine's routable one and
listens on every interface (see docs/scale.md, "Network")."""
CONNECT_TIMEOUT_S = 5.0
"""How long a cluster address gets to accept a TCP connection before `--ray ADDRESS` gives up."""
RAY_EXTRA_HINT = "install it with: pip install 'hypic-rag[ray]'"


class RayUnavailableError(HypicError):
    """Ray is not installed, or the cluster cannot be reached (one line; exit 2: a bad option or set-up)."""

    exit_code = EXIT_BAD_INPUT


def ray_module() -> Any:
    """The `ray` module; `RayUnavailableError` when it is not installed."""
    try:
        import ray
    except ImportError as error:
        raise RayUnavailableError(f"--ray needs Ray ({error}); {RAY_EXTRA_HINT}") from None
    return ray


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """How to reach (or start) a cluster.

    address: "local" (a private instance started here), "auto" (the cluster running on this machine) or an address
    (`host:port` of the GCS, `ray://host:port` for Ray Client). num_cpus / num_gpus: only for "local" (None: what
    this machine has). log_to_driver: stream the workers' logs to this process's stderr.
    """

    address: str = LOCAL
    num_cpus: int | None = None
    num_gpus: int | None = None
    log_to_driver: bool = False

    def __post_init__(self) -> None:
        if not self.address or not self.address.strip():
            raise ValueError("the Ray address is empty (use local, auto or host:port)")
        for name in ("num_cpus", "num_gpus"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")


def connect(options: ClusterConfig | str = LOCAL) -> Any:
    """Initialise Ray for this process (once; a process already connected is left as it is) and return `ray`.

    A private instance ("local") listens on 127.0.0.1 only when Ray is first imported here (the environment may
    say otherwise: `LOOPBACK_ONLY_VARIABLE`); no other machine has a reason to reach it.

    RayUnavailableError when Ray is missing or the address cannot be reached."""
    if isinstance(options, str):
        options = ClusterConfig(address=options)
    if options.address == LOCAL and "ray" not in sys.modules:  # a private instance listens on 127.0.0.1 only
        os.environ.setdefault(LOOPBACK_ONLY_VARIABLE, "0")
    ray = ray_module()
    if ray.is_initialized():
        return ray
    arguments: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": options.log_to_driver,
        "logging_level": logging.WARNING,
        "configure_logging": False,
        # the workers find this process's code (a checkout run with PYTHONPATH) as the driver does
        "runtime_env": {"env_vars": _forwarded_environment()},
    }
    if options.address == LOCAL:
        arguments.update(num_cpus=options.num_cpus, num_gpus=options.num_gpus)
    else:
        check_reachable(options.address)
        arguments["address"] = options.address
    try:
        ray.init(**arguments)
    except (ConnectionError, RuntimeError, ValueError) as error:
        message = " ".join(str(error).split()) or type(error).__name__
        raise RayUnavailableError(f"cannot reach the Ray cluster at {options.address!r}: {message}") from None
    logger.info("connected to Ray: %s", ray.cluster_resources())
    return ray


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """A `host:port` (or `ray://host:port`) address that accepts TCP connections, else `RayUnavailableError` at
    once (Ray itself would retry for many seconds, logging every attempt). "auto" is left to Ray."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise RayUnavailableError(f"not a Ray address: {address!r} (use local, auto, host:port or ray://host:port)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise RayUnavailableError(f"cannot reach the Ray cluster at {address!r}: {reason}") from None


def _forwarded_environment() -> dict[str, str]:
    """Variables every Ray worker gets from this process: where the code is, offline model loading, quiet OpenMP."""
    names = ("PYTHONPATH", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM")
    forwarded = {name: os.environ[name] for name in names if os.environ.get(name)}
    forwarded.setdefault("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    return forwarded


def encoder_slots(ray: Any, *, gpu: bool) -> int:
    """Encoders the cluster can hold at once: one per GPU when `gpu`, else one per CPU slot (at least 1)."""
    resources = ray.cluster_resources()
    return max(1, int(resources.get("GPU" if gpu else "CPU", 0)))


def disconnect_if_local(ray: Any, options: ClusterConfig) -> None:
    """End the private instance `connect` started for "local" (a shared cluster is left running)."""
    if options.address == LOCAL and ray.is_initialized():
        ray.shutdown()
