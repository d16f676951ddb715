"""The one place that says which kernels run a call: our Triton kernels (`hypic_rag.kernels`) or the torch path.

Every op's `dispatch.py` asks here and nowhere else, and only `runtime/ops/` imports `hypic_rag.kernels` (a
structure test holds that). `use_triton(tensor)` follows `HYPIC_RAG_KERNELS` (read at every call):
- "auto" (default): the Triton kernels for CUDA tensors when triton imports; the torch path otherwise;
- "torch": the torch path everywhere;
- "triton": the Triton kernels whatever the device (CPU tensors then need `TRITON_INTERPRET=1`, set before the
  first kernel module is imported: how the CPU tests drive the runtime through the kernels).
Asking never imports triton for a CPU tensor in "auto" mode.
"""

from __future__ import annotations

import torch

from hypic_rag.kernels import triton_enabled

BACKENDS = ("triton", "torch")
"""What a dispatch may be told to use (`backend=`), or picks itself (None)."""


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether our Triton kernels should run on `tensor` (see the module docstring)."""
    return triton_enabled(tensor)


def resolve(backend: str | None, tensor: torch.Tensor) -> str:
    """`backend` checked ("triton" / "torch"), or the switch's choice for `tensor` when it is None."""
    if backend is None:
        return "triton" if use_triton(tensor) else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    return backend
