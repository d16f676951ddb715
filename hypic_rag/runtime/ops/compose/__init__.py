"""Composition of cached affine maps S <- P S + Z (docs/design.md, section 2), for every transition kind.

`naive.py` is the float32 map-by-map reference; the fast paths (`fold.py`) are the torch fold
(`segment_state.apply_in_order`) and the Triton kernels of `hypic_rag.kernels.compose` (one launch for all maps of
one or many requests, optionally storing every intermediate state); `compose_in_order` and `compose_batched` run the
backend `ops/registry.py` picks ("triton" where the switch is on and a kernel takes the maps' kind, else "torch").
"""

from collections.abc import Sequence

import torch

from hypic_rag.runtime.ops.compose.naive import naive_compose
from hypic_rag.runtime.ops.registry import dispatch, select


def select_backend(state: torch.Tensor, kind: str, backend: str | None = None) -> str:
    """"triton" or "torch" for composing maps of `kind` onto one request's `state` [*state_shape] (`backend`
    overrides the switch; "triton" still gives "torch" where no kernel takes the kind / layout)."""
    return select("compose_in_order", state, 0, requested=backend, kind=kind)


@dispatch("compose_in_order")
def compose_in_order(
    start: torch.Tensor, transitions: Sequence[torch.Tensor] | torch.Tensor | None,
    states: Sequence[torch.Tensor] | torch.Tensor, kind: str, *, backend: str | None = None,
) -> torch.Tensor:
    """S <- P_k . (... (P_1 . start + Z_1) ...) + Z_k for one request's consecutive cached spans.

    start [*state_shape]; transitions: k maps [*transition_shape] of `kind` (a list or stacked [k, ...]; None: the
    `addition` baseline, P = identity); states: k maps [*state_shape]. Returns the end state, float32.
    `backend` ("triton" / "torch") overrides the switch (benchmarks compare the two through here)."""


@dispatch("compose_batched")
def compose_batched(
    start: torch.Tensor | None, transitions: torch.Tensor | None, states: torch.Tensor, counts: Sequence[int],
    kind: str, *, store_steps: bool = False, backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """N requests' states advanced over their own runs of maps (contract of `naive_compose` with `counts`):
    start [N, *state_shape] or None (zeros), transitions [M, ...] or None, states [M, *state_shape]; with
    `store_steps` also the state after every map (the seam start-state scan). Float32 results."""


__all__ = ["compose_batched", "compose_in_order", "naive_compose", "select_backend"]
