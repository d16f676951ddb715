"""oneDNN's primitive cache and ideep's primitive-descriptor cache (PyTorch's oneDNN glue) are bounded in every
process that imports the runtime's linears (a service worker's resident memory grew with each new prefill length
while they held their default 1024 shapes each), unless the environment chose a capacity itself."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hypic_rag.runtime.fast_linear import PRIMITIVE_CACHE_CAPACITY


def capacity(variable: str, environment: dict[str, str]) -> str:
    code = f"import os, hypic_rag.runtime.fast_linear; print(os.environ[{variable!r}])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=environment,
                          check=True)
    return done.stdout.strip()


@pytest.mark.parametrize("variable", ["ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"])
def test_the_runtime_bounds_onednn_caches_unless_told(variable: str) -> None:
    base = {key: value for key, value in os.environ.items() if key != variable}
    assert capacity(variable, base) == str(PRIMITIVE_CACHE_CAPACITY) and PRIMITIVE_CACHE_CAPACITY < 1024
    assert capacity(variable, {**base, variable: "7"}) == "7"
