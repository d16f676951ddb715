"""Composition of cached affine maps S <- P S + Z (docs/design.md, section 2), for every transition kind.

`naive.py` is the float32 map-by-map reference; the fast paths are the torch fold (`segment_state.apply_in_order`)
and the Triton kernels of `hypic_rag.kernels.compose` (one launch for all maps of one or many requests, optionally
storing every intermediate state); `dispatch.py` picks one per call (`ops/backends.py` says which may run).
"""

from hypic_rag.runtime.ops.compose.dispatch import compose_batched, compose_in_order, select_backend
from hypic_rag.runtime.ops.compose.naive import naive_compose

__all__ = ["compose_batched", "compose_in_order", "naive_compose", "select_backend"]
