"""Nothing a command started outlives it: SIGKILL of `precompute --workers 2` (its multiprocessing fork server,
resource tracker and two workers) and of `serve --replicas 2` on a private Ray instance (GCS, raylet, Ray's
DashboardAgent and RuntimeEnvAgent, the Serve controller and replicas), real processes: the process tree is listed
while the command runs, the command is killed, and within a few seconds none of those processes runs any more
(they ran on for minutes: `hypic_rag.utils.reaper`). Linux only (/proc)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hypic_rag.testing import free_port
from kits.corpora import SMALL_CORPUS, write_corpus

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240
GONE_WITHIN_S = 10.0
pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its parent to read its status holds nothing and runs nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def kill_when(command: list[str], ready: Callable[[dict[int, str]], bool], family: Callable[[int], dict[int, str]],
              cwd: Path) -> tuple[dict[int, str], list[str]]:
    """Start `command`; once its process tree satisfies `ready`, SIGKILL it. Returns every descendant seen while it
    ran (pid -> command line) and those still running `GONE_WITHIN_S` after the kill."""
    environment = dict(os.environ, PYTHONPATH=str(ROOT), OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1")
    process = subprocess.Popen(command, cwd=cwd, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seen: dict[int, str] = {}
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert process.poll() is None, process.communicate()[1].decode(errors="replace")[-3000:]
            assert time.monotonic() < deadline, f"never ready; its processes: {sorted(seen.values())}"
            tree = family(process.pid)
            seen.update(tree)
            if ready(tree):
                break
            time.sleep(0.1)
        seen.update(family(process.pid))
    finally:
        process.kill()
        process.wait()
    gone_by = time.monotonic() + GONE_WITHIN_S
    while any(running(pid) for pid in seen) and time.monotonic() < gone_by:
        time.sleep(0.2)
    left = [f"{pid}: {line[:120]}" for pid, line in sorted(seen.items()) if running(pid)]
    for pid in seen:  # whatever is left (the failure case) must not outlive the test
        if running(pid):
            os.kill(pid, signal.SIGKILL)
    return seen, left


def test_a_killed_precompute_leaves_no_worker_fork_server_or_tracker(tiny_model: Path, tmp_path: Path,
                                                                     process_family) -> None:
    corpus = write_corpus(tmp_path / "corpus", {f"{n}-{name}": text * 6 for n in range(8)
                                               for name, text in SMALL_CORPUS.items()})

    def two_workers(tree: dict[int, str]) -> bool:  # the fork server and the two workers forked from it
        return sum("multiprocessing.forkserver" in line for line in tree.values()) >= 3

    seen, left = kill_when([sys.executable, "-m", "hypic_rag", "precompute", str(corpus), "--index",
                            str(tmp_path / "index"), "--model", str(tiny_model), "--workers", "2", "--device", "cpu",
                            "--no-progress"], two_workers, process_family, tmp_path)
    assert any("resource_tracker" in line for line in seen.values()), seen
    assert left == []


def test_a_killed_replicated_server_leaves_no_ray_process(copy_tiny_index, tmp_path: Path, process_family) -> None:
    pytest.importorskip("ray", reason="ray is not installed (pip install 'hypic-rag[ray]')")
    index = copy_tiny_index(tmp_path / "index")

    def agents_up(tree: dict[int, str]) -> bool:  # what Ray left running after its driver was killed
        lines = list(tree.values())
        return any("DashboardAgent" in line for line in lines) and any("RuntimeEnvAgent" in line for line in lines)

    seen, left = kill_when([sys.executable, "-m", "hypic_rag", "serve", "--index", str(index), "--port",
                            str(free_port()), "--replicas", "2", "--replica-cpus", "0.5", "--device", "cpu",
                            "--log-level", "warning"], agents_up, process_family, tmp_path)
    assert any("raylet" in line for line in seen.values()) and any("gcs_server" in line for line in seen.values())
    assert left == []
