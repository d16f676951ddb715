"""The Triton kernel tests: on CUDA when there is a GPU, else on CPU tensors under Triton's interpreter.

`TRITON_INTERPRET=1` must be set before any kernel module is imported (triton.jit reads it when a kernel is
defined), so this directory runs in its own pytest process (`make test` runs it after the main suite; a bare
`pytest tests` also works, as nothing before it imports the kernel modules). Without triton the tests skip.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import triton  # noqa: F401
    except ImportError:
        skip = pytest.mark.skip(reason="triton is not installed (pip install -e '.[test]')")
        for item in items:
            if "tests/kernels" in str(item.fspath).replace(os.sep, "/"):
                item.add_marker(skip)
