"""`HYPIC_RAG_FLA_AUTOTUNE_CONFIGS` (what scripts/gpu_check.sh sets so that fla's autotuning fits a short GPU run):
every Triton autotuner created after `hypic_rag.kernels` is imported keeps at most N configurations, the fewest
stages and 4 warps first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from hypic_rag.kernels.autotune import preferred_configs

ROOT = Path(__file__).resolve().parents[2]


def test_preferred_configs_keep_fewest_stages_and_four_warps_first() -> None:
    configs = [triton.Config({"BK": bk}, num_warps=warps, num_stages=stages)
               for bk in (32, 64) for warps in (1, 4, 8) for stages in (3, 2)]
    kept = preferred_configs(configs, 2)
    assert [(c.kwargs["BK"], c.num_warps, c.num_stages) for c in kept] == [(32, 4, 2), (64, 4, 2)]
    assert preferred_configs(configs[:1], 2) == configs[:1]
    with pytest.raises(ValueError, match="positive"):
        preferred_configs(configs, 0)


def test_the_environment_variable_caps_autotuners_created_afterwards() -> None:
    code = (
        "import hypic_rag.kernels, triton, triton.language as tl\n"
        "configs = [triton.Config({'B': b}, num_warps=w, num_stages=s) for b in (16, 32) for w in (2, 4, 8) for s in (2, 3, 4)]\n"
        "@triton.autotune(configs=configs, key=['n'])\n"
        "@triton.jit\n"
        "def kernel(x, n, B: tl.constexpr):\n"
        "    pass\n"
        "print(len(kernel.configs), sorted({c.num_stages for c in kernel.configs}), sorted({c.num_warps for c in kernel.configs}))\n"
    )
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "HYPIC_RAG_FLA_AUTOTUNE_CONFIGS": "2"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "2 [2] [4]"
    environment.pop("HYPIC_RAG_FLA_AUTOTUNE_CONFIGS")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=120)
    assert done.stdout.strip() == "18 [2, 3, 4] [2, 4, 8]"  # untouched without it
