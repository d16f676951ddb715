"""oneDNN's primitive cache is bounded in every process that imports the runtime's linears (a service worker's
resident memory grew with each new prefill length while it held oneDNN's default 1024 compiled shapes), unless the
environment chose a capacity itself."""

from __future__ import annotations

import os
import subprocess
import sys

from hypic_rag.runtime.fast_linear import PRIMITIVE_CACHE_CAPACITY

CODE = "import os, hypic_rag.runtime.fast_linear; print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])"


def capacity(environment: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120, env=environment,
                          check=True)
    return done.stdout.strip()


def test_the_runtime_bounds_onednn_primitive_cache_unless_told() -> None:
    base = {key: value for key, value in os.environ.items() if key != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    assert capacity(base) == str(PRIMITIVE_CACHE_CAPACITY) and PRIMITIVE_CACHE_CAPACITY < 1024
    assert capacity({**base, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "7"}) == "7"
