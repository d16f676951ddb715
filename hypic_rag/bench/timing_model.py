"""Random-weight qwen3_5-shaped models for timing (quality on them is deviation from `full`)."""

from __future__ import annotations

from typing import Any

from hypic_rag.testing import build_tiny_model

TIMING_MODELS: dict[str, dict[str, Any]] = {
    # ~174M parameters: 16 layers (12 Gated DeltaNet + 4 gated attention), hidden 768, vocab 32k
    "medium": dict(
        vocab_size=32000, hidden_size=768, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=2,
        head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64,
        linear_value_head_dim=64, intermediate_size=2048,
    ),
    # the test suite's tiny shape
    "tiny": dict(vocab_size=256),
    # ~9M parameters, for `--quick` on 2 CPU cores
    "small": dict(
        vocab_size=4096, hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
        linear_value_head_dim=32, intermediate_size=768,
    ),
}


def build_timing_model(name: str, seed: int = 0):
    """A seeded random transformers model of the named shape (slow decays, peaked attention)."""
    if name not in TIMING_MODELS:
        raise ValueError(f"unknown timing model {name!r}; choose one of {', '.join(TIMING_MODELS)}")
    return build_tiny_model("qwen3_5", seed=seed, initializer_range=0.05, **TIMING_MODELS[name])
