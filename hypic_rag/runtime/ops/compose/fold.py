"""The backends of composing cached affine maps S <- P S + Z, as `ops/registry.py` calls them.

- "triton": one launch for all the maps of a request (or of many requests), reading P / Z in their storage dtype
  and accumulating in float32: `hypic_rag.kernels.compose` for matrix P on [H, K, V] states (the delta rules),
  `hypic_rag.kernels.compose_elementwise` for scalar-per-head P (SSD, lightning) and elementwise P (Mamba1's
  [D, N], per-channel gates) on [H, K, V] or [D, N] states;
- "torch": the fold of `segment_state.apply_in_order` (one batched product per map for matrix P; elementwise
  products otherwise). `naive.py` is the reference both are tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hypic_rag.runtime.ops.compose.naive import naive_compose
from hypic_rag.runtime.segment_state import apply_in_order

Maps = Sequence[torch.Tensor] | torch.Tensor


def _stacked(tensors: Maps | None) -> torch.Tensor | None:
    if tensors is None or isinstance(tensors, torch.Tensor):
        return tensors
    return torch.stack(list(tensors))


def compose_batched_triton(
    start: torch.Tensor | None, transitions: torch.Tensor | None, states: torch.Tensor, counts: Sequence[int],
    kind: str, store_steps: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Contract of `naive_compose` in one Triton launch (matrix P: `compose_affine_batched`; scalar / elementwise
    P: `compose_elementwise_batched`)."""
    if kind == "matrix":
        from hypic_rag.kernels.compose import compose_affine_batched

        return compose_affine_batched(start, transitions, states, counts, store_steps=store_steps)
    from hypic_rag.kernels.compose_elementwise import compose_elementwise_batched

    return compose_elementwise_batched(start, transitions, states, counts, store_steps=store_steps)


def compose_in_order_triton(start: torch.Tensor, transitions: Maps | None, states: Maps, kind: str) -> torch.Tensor:
    """One request's maps as a batch of one Triton launch: start [*state_shape] -> end state, float32."""
    stacked = _stacked(states)
    return compose_batched_triton(start[None], _stacked(transitions), stacked, [stacked.shape[0]], kind)[0]


def compose_in_order_torch(start: torch.Tensor, transitions: Maps | None, states: Maps, kind: str) -> torch.Tensor:
    """One request's maps folded in torch (`apply_in_order`): start [*state_shape] -> end state, float32."""
    listed = list(states) if not isinstance(states, torch.Tensor) else list(states.unbind(0))
    if transitions is not None and isinstance(transitions, torch.Tensor):
        transitions = list(transitions.unbind(0))
    return apply_in_order(start, transitions, listed, kind)


def naive_compose_in_order(start: torch.Tensor, transitions: Maps | None, states: Maps, kind: str) -> torch.Tensor:
    """The float32 reference of one request's maps (`naive_compose` with one request)."""
    stacked = _stacked(states)
    return naive_compose(start[None], _stacked(transitions), stacked, [stacked.shape[0]], kind=kind)[0]


def compose_batched_torch(
    start: torch.Tensor | None, transitions: torch.Tensor | None, states: torch.Tensor, counts: Sequence[int],
    kind: str, store_steps: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Contract of `naive_compose`: each request's run of maps folded in torch (`naive_compose` itself when every
    intermediate state is asked for)."""
    if store_steps:
        return naive_compose(start, transitions, states, counts, kind=kind, store_steps=True)
    ends, first = [], 0
    for request, count in enumerate(int(count) for count in counts):
        begin = states.new_zeros(states.shape[1:], dtype=torch.float32) if start is None else start[request]
        ends.append(compose_in_order_torch(
            begin, None if transitions is None else transitions[first : first + count], states[first : first + count],
            kind,
        ))
        first += count
    if not ends:
        return states.new_zeros((0, *states.shape[1:]), dtype=torch.float32)
    return torch.stack(ends)
