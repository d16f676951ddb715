"""Names of the tensors in a segment entry (see docs/CONTRACTS.md)."""

from __future__ import annotations

import torch

TOKEN_IDS = "token_ids"
SEAM_TOKENS = "seam_tokens"
KEY_VALUE_SUFFIXES = (".key", ".value")


def tensor_name(layer_index: int, part: str) -> str:
    return f"layers.{layer_index}.{part}"


def entry_nbytes(entry: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(linear-state bytes, key/value bytes) of an entry (the cache's `layout.entry_bytes` split)."""
    from hypic_rag.cache.layout import entry_bytes

    sizes = entry_bytes(entry)
    return sizes.linear_bytes, sizes.kv_bytes
