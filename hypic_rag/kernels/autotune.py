"""Fewer autotuning configurations for every Triton autotuner in the process (fla's kernels, in practice).

fla autotunes each of its kernels over dozens of configurations (block sizes x warps x stages) on first use per
head shape, each compiled and timed: minutes per shape, more than a short GPU check can spend. With
`HYPIC_RAG_FLA_AUTOTUNE_CONFIGS=N` set before `hypic_rag.kernels` is imported (scripts/gpu_check.sh sets 2), every
autotuner created afterwards keeps at most N of its configurations, preferring the fewest pipeline stages (least
shared memory, so the kept ones compile for any shape) and 4 warps, in the kernel's own order otherwise. Kernels
then run with a sound configuration rather than the best one for the shape: a measured trade-off that the GPU
benchmark records with its numbers; transformers' own forward, in the same process, runs under the same limit.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

logger = logging.getLogger(__name__)

AUTOTUNE_CONFIGS_ENV = "HYPIC_RAG_FLA_AUTOTUNE_CONFIGS"


def preferred_configs(configs: list[Any], limit: int) -> list[Any]:
    """At most `limit` of `configs` (triton.Config): fewest stages first, then warps nearest 4, stable otherwise."""
    if limit < 1:
        raise ValueError(f"{AUTOTUNE_CONFIGS_ENV} must be a positive count, got {limit}")

    def rank(config: Any) -> tuple[int, float]:
        stages = getattr(config, "num_stages", None) or 0
        warps = getattr(config, "num_warps", None) or 4
        return stages, abs(math.log2(warps) - 2)

    return sorted(configs, key=rank)[:limit] if len(configs) > limit else list(configs)


def limit_autotuning(limit: int) -> None:
    """Make every `triton.runtime.autotuner.Autotuner` created from now on keep `preferred_configs(configs, limit)`
    (idempotent: a second call changes the limit)."""
    from triton.runtime import autotuner

    original = getattr(autotuner.Autotuner.__init__, "__wrapped__", autotuner.Autotuner.__init__)

    @functools.wraps(original)
    def limited(self, fn, arg_names, configs, *args, **kwargs):
        return original(self, fn, arg_names, preferred_configs(list(configs), limit), *args, **kwargs)

    autotuner.Autotuner.__init__ = limited
    logger.info("Triton autotuners keep at most %d configurations each (%s)", limit, AUTOTUNE_CONFIGS_ENV)
