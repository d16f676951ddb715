"""Where the kernel tests run (imported by the test modules; conftest.py has set TRITON_INTERPRET by then)."""

from __future__ import annotations

import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") else "cpu"
"""Where the kernels run: a GPU, or CPU tensors under the interpreter."""

STORAGE_DTYPES = (torch.float32, torch.float16) + ((torch.bfloat16,) if DEVICE == "cuda" else ())
"""Storage dtypes to test (the interpreter stores bfloat16 as raw 16-bit integers: wrong values, so GPU only)."""

RUNTIME_TOLERANCE = 1e-5 if DEVICE == "cpu" else 2e-3
"""Runtime through the kernels vs the torch path: float32 on CPU; on a GPU fla's TF32 runs of the seams and the
question start from states that differ in the last float32 bits, which TF32 rounding can magnify."""
