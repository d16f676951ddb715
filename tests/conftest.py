"""Shared fixtures. Tests run offline on CPU with tiny random models."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (spinning threads: 10x slower)

import logging  # noqa: E402

import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
logging.getLogger("transformers").setLevel(logging.ERROR)
