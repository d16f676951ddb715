"""Test kits, for tests and benchmarks: `tiny` (tiny random hybrid models and tokenizers, no network, seconds to build;
corpora and indexes; its names are importable from here), `ssm` (tiny Mamba-family hybrids and published-layout
stand-ins), `s3` (a local S3-compatible server), `mixer_checks` (the mixer interface's contract as executable checks),
`service_page` and `browser` (the page `serve` shows, driven in a headless browser), `shards`.
"""

from __future__ import annotations

from hypic_rag.testing.tiny import (
    LINEAR_FAMILY_TINY_TYPES,
    SUPPORTED_TINY_TYPES,
    adjust_linear_family_model,
    build_tiny_model,
    free_port,
    linear_family_config,
    save_tiny_checkpoint,
    tiny_config,
    train_tiny_tokenizer,
)

__all__ = [
    "LINEAR_FAMILY_TINY_TYPES",
    "SUPPORTED_TINY_TYPES",
    "adjust_linear_family_model",
    "build_tiny_model",
    "free_port",
    "linear_family_config",
    "save_tiny_checkpoint",
    "tiny_config",
    "train_tiny_tokenizer",
]
