"""The burst benchmark's readings of a process (`hypic_rag.bench.burst_memory`), on this test's own process: the
split by kind of mapping adds up to the resident set, the process tree and thread count see what is there."""

from __future__ import annotations

import os
import subprocess
import sys

from hypic_rag.bench.burst_memory import mapping_rss_mib, rss_mib, thread_count
from hypic_rag.bench.server_clients import process_tree, tree_cpu_seconds


def test_the_mapping_kinds_add_up_to_the_resident_set() -> None:
    kinds = mapping_rss_mib(os.getpid())
    total = rss_mib(os.getpid())
    assert kinds is not None and total is not None
    assert kinds["file"] > 0 and kinds["anon"] > 0 and kinds["anon_maps"] >= 1
    assert abs(kinds["heap"] + kinds["anon"] + kinds["file"] - total) < 0.1 * total  # read a moment apart


def test_a_child_is_in_the_tree_and_a_gone_process_reads_none() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert process_tree(os.getpid())[0] == os.getpid() and child.pid in process_tree(os.getpid())
        assert thread_count(child.pid) == 1
        cpu = tree_cpu_seconds(os.getpid())  # the server bench's CPU-time figures read the same tree
        assert set(cpu) == set(process_tree(os.getpid())) and cpu[os.getpid()] > 0
    finally:
        child.kill()
        child.wait()
    assert rss_mib(child.pid) is None and mapping_rss_mib(child.pid) is None and thread_count(child.pid) is None
