"""GPU kernels, installed as `hypic_rag.kernels` (the `gpu` extra brings flash-linear-attention and triton).

- `compose.py`: S <- P_k(...(P_1 S + Z_1)...) + Z_k for matrix P (delta rules) in one Triton launch (one request or
  many), optionally storing every intermediate state (the seam start-state scan); `compose_elementwise.py`: the
  same for scalar-per-head P (SSD, lightning) and elementwise P (Mamba1); `runs.py`: their per-request runs.
- `conv_tail.py`: conv tails carried across spans, many requests in one launch.
- `rope.py`: cached pre-RoPE keys rotated at their true positions straight into the attention K buffer.
- `gated_delta_rule.py`, `kda.py`, `simple_gla.py`: flash-linear-attention's chunked, fused-recurrent and varlen
  kernels behind the runtime's contract (`fla_support.py`: what they share).
Each kernel's torch reference lives in `hypic_rag.runtime.ops/<op>/naive.py`; the one ops registry
(`hypic_rag.runtime.ops.registry`) names each kernel with the condition under which it runs: nothing outside
`hypic_rag.runtime.ops` imports this package (a structure test holds that). The CPU
tests run the Triton kernels under `TRITON_INTERPRET=1`.

Importing this package never imports triton, fla or a GPU library. `triton_enabled(tensor)` is the switch
`hypic_rag.runtime.ops.backends` asks, read at every call from `HYPIC_RAG_KERNELS`:
- "auto" (default): the Triton kernels for CUDA tensors when triton imports; the torch path otherwise.
- "torch": never (the torch path everywhere; also keeps fla out).
- "triton": always, whatever the device (CPU tensors then need `TRITON_INTERPRET=1`, set before the first kernel
  module is imported: how the CPU tests drive the runtime through the kernels).
`HYPIC_RAG_FLA_AUTOTUNE_CONFIGS=N` (the GPU check) imports triton here to cap every autotuner at N configurations
(`autotune.py`).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

KERNELS_ENV = "HYPIC_RAG_KERNELS"
KERNEL_MODES = ("auto", "torch", "triton")


def kernel_mode() -> str:
    """The value of HYPIC_RAG_KERNELS ("auto" when unset; an unknown value is logged once and read as "auto")."""
    mode = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if mode not in KERNEL_MODES:
        _warn_unknown_mode(mode)
        return "auto"
    return mode


@functools.cache
def _warn_unknown_mode(mode: str) -> None:
    logger.warning("%s=%r is not one of %s; using 'auto'", KERNELS_ENV, mode, ", ".join(KERNEL_MODES))


@functools.cache
def triton_importable() -> bool:
    """Whether triton imports here (imported at most once, and only when asked)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """True when Triton kernels run under its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_enabled(tensor: Any) -> bool:
    """Whether the runtime should run its own Triton kernels on `tensor` (see the module docstring)."""
    mode = kernel_mode()
    if mode == "torch":
        return False
    if mode == "triton":
        return True
    return bool(getattr(tensor, "is_cuda", False)) and triton_importable()


def _limit_autotuning_from_environment() -> None:
    value = os.environ.get("HYPIC_RAG_FLA_AUTOTUNE_CONFIGS", "").strip()
    if value and triton_importable():
        from hypic_rag.kernels.autotune import limit_autotuning

        limit_autotuning(int(value))


_limit_autotuning_from_environment()
