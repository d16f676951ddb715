"""Entries with the names and shapes the runtime produces, filled with seeded random values.

For tests and benchmarks of the cache that need realistic entries without running a model: `entry_shapes`
derives every tensor's shape from a hybrid model config (docs/CONTRACTS.md), `synthetic_entry` fills them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hypic_rag.entry.schema import (
    ATTENTION_LAYER,
    LINEAR_LAYER,
    SEAM_TOKENS,
    TOKEN_IDS,
    Entry,
    is_kv_name,
    layer_parts,
    tensor_name,
)


@dataclass(frozen=True, slots=True)
class HybridShape:
    """The dimensions of a hybrid stack that decide an entry's tensor shapes.

    layer_types: per layer `LINEAR_LAYER` ("linear_attention") or `ATTENTION_LAYER` ("full_attention").
    linear_value_heads H, linear_key_dim K, linear_value_dim V: the state of a linear layer is [H, K, V].
    conv_dim, conv_kernel: the short causal conv over q, k and v (conv_dim = 2 * key heads * K + H * V).
    kv_heads, head_dim: the attention layers' K/V [kv_heads, L, head_dim].
    """

    layer_types: tuple[str, ...]
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int
    conv_dim: int
    conv_kernel: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: Any) -> HybridShape:
        """From a transformers qwen3_5 / qwen3_next style text config."""
        config = getattr(config, "text_config", None) or config
        key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        key_dim, value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            layer_types=tuple(config.layer_types),
            linear_value_heads=value_heads,
            linear_key_dim=key_dim,
            linear_value_dim=value_dim,
            conv_dim=2 * key_heads * key_dim + value_heads * value_dim,
            conv_kernel=config.linear_conv_kernel_dim,
            kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
        )


def entry_shapes(shape: HybridShape, length: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of an entry for a chunk of `length` tokens (besides ``seam_tokens``)."""
    heads, key_dim, value_dim = shape.linear_value_heads, shape.linear_key_dim, shape.linear_value_dim
    shapes: dict[str, tuple[int, ...]] = {TOKEN_IDS: (length,)}
    part_shapes = {
        "transition": (heads, key_dim, key_dim),
        "suffix_state": (heads, key_dim, value_dim),
        "conv_tail": (shape.conv_dim, shape.conv_kernel - 1),
        "key": (shape.kv_heads, length, shape.head_dim),
        "value": (shape.kv_heads, length, shape.head_dim),
    }
    for index, kind in enumerate(shape.layer_types):
        for part in layer_parts(kind):
            shapes[tensor_name(index, part)] = part_shapes[part]
    return shapes


def synthetic_entry(
    shape: HybridShape, token_ids: Sequence[int], *, seed: int = 0, seam_tokens: int = 8,
    kv_dtype: torch.dtype = torch.float32,
) -> Entry:
    """An entry for `token_ids` with seeded standard-normal float32 state and `kv_dtype` K/V."""
    generator = torch.Generator().manual_seed(seed)
    entry: Entry = {
        TOKEN_IDS: torch.tensor(list(token_ids), dtype=torch.int64),
        SEAM_TOKENS: torch.tensor(seam_tokens, dtype=torch.int64),
    }
    for name, tensor_shape in entry_shapes(shape, len(token_ids)).items():
        if name == TOKEN_IDS:
            continue
        dtype = kv_dtype if is_kv_name(name) else torch.float32
        entry[name] = torch.randn(tensor_shape, generator=generator).to(dtype)
    return entry


TINY_SHAPE = HybridShape(
    layer_types=(LINEAR_LAYER, LINEAR_LAYER, LINEAR_LAYER, ATTENTION_LAYER),
    linear_value_heads=4, linear_key_dim=16, linear_value_dim=16, conv_dim=128, conv_kernel=4,
    kv_heads=2, head_dim=16,
)
"""The shape of `hypic_rag.testing.tiny_config("qwen3_5")` (3 linear layers, 1 attention layer)."""
