"""Names of the tensors in a segment entry (see docs/CONTRACTS.md)."""

from __future__ import annotations

import torch

TOKEN_IDS = "token_ids"
SEAM_TOKENS = "seam_tokens"
LINEAR_STATE_SUFFIXES = (".transition", ".suffix_state", ".conv_tail")
KEY_VALUE_SUFFIXES = (".key", ".value")


def tensor_name(layer_index: int, part: str) -> str:
    return f"layers.{layer_index}.{part}"


def entry_token_ids(entry: dict[str, torch.Tensor]) -> list[int]:
    return entry[TOKEN_IDS].tolist()


def entry_seam_tokens(entry: dict[str, torch.Tensor]) -> int:
    return int(entry[SEAM_TOKENS])


def entry_nbytes(entry: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(linear-state bytes, key/value bytes) of an entry."""
    linear = key_value = 0
    for name, tensor in entry.items():
        size = tensor.numel() * tensor.element_size()
        if name.endswith(KEY_VALUE_SUFFIXES):
            key_value += size
        elif name.endswith(LINEAR_STATE_SUFFIXES):
            linear += size
    return linear, key_value
