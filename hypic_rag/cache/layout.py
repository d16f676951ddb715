"""What the tensors of a segment entry are, for byte accounting and the linear-state storage dtype.

An entry is a plain ``dict[str, torch.Tensor]`` (docs/CONTRACTS.md): ``token_ids`` int64 [L]; per linear layer
``layers.{i}.transition`` [H, K, K], ``layers.{i}.suffix_state`` [H, K, V],
``layers.{i}.conv_tail`` [conv_dim, kernel-1]; per attention layer ``layers.{i}.key`` / ``layers.{i}.value``
[H_kv, L, D]. Names ending ``.key`` / ``.value`` are K/V; every other tensor but ``token_ids`` is linear state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hypic_rag.runtime.entry import KEY_VALUE_SUFFIXES as KV_SUFFIXES
from hypic_rag.runtime.entry import TOKEN_IDS

LOWERABLE_STATE_SUFFIXES = (".transition", ".suffix_state")
"""The P/Z tensors whose storage dtype follows `CacheNamespace.state_dtype` (conv tails and K/V keep theirs)."""


@dataclass(frozen=True, slots=True)
class EntryBytes:
    """Byte sizes of an entry's tensors, split by kind (token ids and any header are in neither)."""

    linear_bytes: int
    kv_bytes: int
    token_id_bytes: int

    @property
    def tensor_bytes(self) -> int:
        return self.linear_bytes + self.kv_bytes + self.token_id_bytes


def is_kv_name(name: str) -> bool:
    """True for attention K/V tensors."""
    return name.endswith(KV_SUFFIXES)


def is_lowerable_state_name(name: str) -> bool:
    """True for the P/Z tensors that may be stored in a lower precision."""
    return name.endswith(LOWERABLE_STATE_SUFFIXES)


def entry_bytes(entry: Mapping[str, torch.Tensor]) -> EntryBytes:
    """Bytes of an entry's tensors as held (after any storage cast), split into linear state, K/V and token ids."""
    linear = kv = token_ids = 0
    for name, tensor in entry.items():
        size = tensor.numel() * tensor.element_size()
        if name == TOKEN_IDS:
            token_ids += size
        elif is_kv_name(name):
            kv += size
        else:
            linear += size
    return EntryBytes(linear_bytes=linear, kv_bytes=kv, token_id_bytes=token_ids)


def entry_token_ids(entry: Mapping[str, torch.Tensor]) -> list[int]:
    """The entry's ``token_ids`` tensor [L] as a list; KeyError if it has none."""
    return entry[TOKEN_IDS].reshape(-1).tolist()


def lower_state_precision(entry: Mapping[str, torch.Tensor], state_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A new dict with the P/Z tensors cast to `state_dtype` (others shared, not copied).

    A tensor whose values exceed the range of `state_dtype` (float16 tops out at 65504) keeps its dtype rather
    than turn into infinities; decoding casts every P/Z tensor back to float32 either way.
    """
    return {
        name: tensor.to(state_dtype) if _lowerable(name, tensor, state_dtype) else tensor
        for name, tensor in entry.items()
    }


def _lowerable(name: str, tensor: torch.Tensor, state_dtype: torch.dtype) -> bool:
    if not is_lowerable_state_name(name) or not tensor.is_floating_point() or tensor.dtype == state_dtype:
        return False
    if tensor.numel() == 0 or torch.finfo(state_dtype).max >= torch.finfo(tensor.dtype).max:
        return True
    return bool(tensor.abs().max() <= torch.finfo(state_dtype).max)


def restore_state_precision(entry: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A new dict with the P/Z tensors back in float32, the dtype composition runs in (no-op if already fp32)."""
    return {
        name: tensor.float() if is_lowerable_state_name(name) and tensor.is_floating_point() else tensor
        for name, tensor in entry.items()
    }
