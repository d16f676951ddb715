"""Whatever a command starts goes when it goes, however it ends (exit, crash, Ctrl-C, SIGKILL).

    from hypic_rag.utils.reaper import reap_on_exit
    reap_on_exit()   # first thing in a command that starts processes

`reap_on_exit` starts a watchdog, a small process of its own session (so a terminal's Ctrl-C leaves it to do its
job), that records the command's descendants every `POLL_S` seconds. When the command is gone (the watchdog, its
child, is re-parented) it stops every process it recorded that still runs, and their own descendants: SIGTERM,
then SIGKILL after `GRACE_S`. So the worker processes of `precompute --workers N` with their multiprocessing fork
server and resource tracker, and the private Ray instance of `serve --replicas N` with the raylet's agents
(DashboardAgent, RuntimeEnvAgent, which Ray itself left running after its driver was killed), end within a few
seconds of the command, and a restart finds no stale process holding a port or a file.

Only processes started after `reap_on_exit` are the command's: what already ran (a test runner's own helpers) is
left alone, as is every process that is not a descendant (a Ray cluster the command merely connected to). A
recorded pid is only signalled while it still has the start time it was recorded with, so a pid the system
reused is never touched. Linux only (it reads /proc); elsewhere `reap_on_exit` does nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

POLL_S = 0.5
"""How often the watchdog looks at the command's descendants (and whether the command is still there)."""
GRACE_S = 3.0
"""How long stopped processes get between SIGTERM and SIGKILL."""
PROC = Path("/proc")

_started: subprocess.Popen[bytes] | None = None


def reap_on_exit() -> subprocess.Popen[bytes] | None:
    """Start this process's watchdog (once; later calls return the same one). None where /proc is missing."""
    global _started
    if _started is not None or not (PROC / str(os.getpid()) / "stat").exists():
        return _started
    _started = subprocess.Popen(
        [sys.executable, "-m", "hypic_rag.utils.reaper", str(os.getpid())],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True,
    )
    logger.debug("watchdog %d reaps what process %d starts", _started.pid, os.getpid())
    return _started


# ------------------------------------------------------------------------------------------------ the watchdog
def start_time(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks after boot), or None when there is no such live process."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])  # a zombie is as good as gone


def children(pid: int) -> set[int]:
    """The direct children of `pid`: its threads' `children` files, or a scan of /proc where the kernel has none."""
    tasks = PROC / str(pid) / "task"
    try:
        threads = list(tasks.iterdir())
    except OSError:
        return set()  # gone
    found: set[int] = set()
    try:
        for task in threads:
            found.update(int(word) for word in (task / "children").read_text().split())
        return found
    except OSError:
        if not (threads[0] / "children").exists() and tasks.exists():
            return _children_by_scan(pid)
        return found  # a thread ended meanwhile: the next look sees the rest


def _children_by_scan(pid: int) -> set[int]:
    found = set()
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.add(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def descendants(roots: Iterable[int]) -> set[int]:
    """Every process below `roots` (the roots excluded)."""
    found: set[int] = set()
    frontier = set(roots)
    while frontier:
        below = set().union(*(children(pid) for pid in frontier)) - found
        found |= below
        frontier = below
    return found


def _alive(recorded: dict[int, int]) -> dict[int, int]:
    """Those of `recorded` (pid -> start time) that still run with the same start time."""
    return {pid: began for pid, began in recorded.items() if start_time(pid) == began}


def _stop(recorded: dict[int, int]) -> None:
    """SIGTERM to every recorded process still running (and to what it started meanwhile), then SIGKILL to those
    still there after `GRACE_S`."""
    recorded = dict(recorded)
    for pid in descendants(_alive(recorded)):
        began = start_time(pid)
        if began is not None:
            recorded.setdefault(pid, began)
    for sent in (signal.SIGTERM, signal.SIGKILL):
        targets = _alive(recorded)
        for pid in targets:
            try:
                os.kill(pid, sent)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + GRACE_S
        while _alive(recorded) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _alive(recorded):
            return


def watch(command: int) -> None:
    """Record `command`'s descendants until it is gone, then stop them (the watchdog's main loop)."""
    me = os.getpid()
    already = descendants([command]) | {me}  # what ran before the watchdog did is not the command's doing
    recorded: dict[int, int] = {}
    while os.getppid() == command and start_time(command) is not None:
        for pid in descendants([command]) - already:
            began = start_time(pid)
            if began is not None:
                recorded.setdefault(pid, began)
        time.sleep(POLL_S)
    _stop(recorded)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the command's end ends the watchdog
    watch(int(sys.argv[1]))
