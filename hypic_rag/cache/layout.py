"""How the cache stores an entry's tensors: which linear-state tensors may be kept in a lower precision.

The entry format itself (tensor names, `Entry`, `entry_bytes`) is `hypic_rag.entry`, shared with the runtime.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hypic_rag.entry import TOKEN_IDS, Entry

LOWERABLE_STATE_SUFFIXES = (".transition", ".suffix_state")
"""The P/Z tensors whose storage dtype follows `CacheNamespace.state_dtype` (conv tails and K/V keep theirs)."""


def is_lowerable_state_name(name: str) -> bool:
    """True for the P/Z tensors that may be stored in a lower precision."""
    return name.endswith(LOWERABLE_STATE_SUFFIXES)


def entry_token_ids(entry: Mapping[str, torch.Tensor]) -> list[int]:
    """The entry's ``token_ids`` tensor [L] as a list; KeyError if it has none."""
    return entry[TOKEN_IDS].reshape(-1).tolist()


def lower_state_precision(entry: Mapping[str, torch.Tensor], state_dtype: torch.dtype) -> Entry:
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


def restore_state_precision(entry: Mapping[str, torch.Tensor]) -> Entry:
    """A new dict with the P/Z tensors back in float32, the dtype composition runs in (no-op if already fp32)."""
    return {
        name: tensor.float() if is_lowerable_state_name(name) and tensor.is_floating_point() else tensor
        for name, tensor in entry.items()
    }
