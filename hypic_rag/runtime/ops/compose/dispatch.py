"""The one place that picks how cached affine maps are composed (`backends.py` says which kernels may run).

- "triton": one launch for all the maps of a request (or of many requests), reading P / Z in their storage dtype
  and accumulating in float32: `hypic_rag.kernels.compose` for matrix P on [H, K, V] states (the delta rules),
  `hypic_rag.kernels.compose_elementwise` for scalar-per-head P (SSD, lightning) and elementwise P (Mamba1's
  [D, N], per-channel gates) on [H, K, V] or [D, N] states;
- "torch": the fold of `segment_state.apply_in_order` (one batched product per map for matrix P; elementwise
  products otherwise); `naive.py` is the reference both are tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hypic_rag.runtime.ops import backends
from hypic_rag.runtime.ops.compose.naive import naive_compose
from hypic_rag.runtime.segment_state import apply_in_order


def _stacked(tensors: Sequence[torch.Tensor] | torch.Tensor | None) -> torch.Tensor | None:
    if tensors is None or isinstance(tensors, torch.Tensor):
        return tensors
    return torch.stack(list(tensors))


def _has_kernel(state: torch.Tensor, kind: str) -> bool:
    """Whether a Triton kernel composes maps of `kind` on one request's `state`."""
    if kind == "matrix":
        return state.dim() == 3
    return kind in ("scalar", "vector") and state.dim() in (2, 3)


def select_backend(state: torch.Tensor, kind: str, backend: str | None = None) -> str:
    """"triton" or "torch" for composing maps of `kind` onto one request's `state` [*state_shape]."""
    chosen = backends.resolve(backend, state)
    if chosen == "triton" and not _has_kernel(state, kind):
        return "torch"  # no kernel for this kind / layout: the torch fold
    return chosen


def _triton_batched(
    start: torch.Tensor | None,
    transitions: torch.Tensor | None,
    states: torch.Tensor,
    counts: Sequence[int],
    kind: str,
    store_steps: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if kind == "matrix":
        from hypic_rag.kernels.compose import compose_affine_batched

        return compose_affine_batched(start, transitions, states, counts, store_steps=store_steps)
    from hypic_rag.kernels.compose_elementwise import compose_elementwise_batched

    return compose_elementwise_batched(start, transitions, states, counts, store_steps=store_steps)


def compose_in_order(
    start: torch.Tensor,
    transitions: Sequence[torch.Tensor] | torch.Tensor | None,
    states: Sequence[torch.Tensor] | torch.Tensor,
    kind: str,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """S <- P_k . (... (P_1 . start + Z_1) ...) + Z_k for one request's consecutive cached spans.

    start [*state_shape]; transitions: k maps [*transition_shape] of `kind` (a list or stacked [k, ...]; None: the
    `addition` baseline, P = identity); states: k maps [*state_shape]. Returns the end state, float32.
    `backend` ("triton" / "torch") overrides the switch (benchmarks compare the two through here)."""
    if select_backend(start, kind, backend) == "triton":
        stacked = _stacked(states)
        return _triton_batched(start[None], _stacked(transitions), stacked, [stacked.shape[0]], kind, False)[0]
    listed = list(states) if not isinstance(states, torch.Tensor) else list(states.unbind(0))
    if transitions is not None and isinstance(transitions, torch.Tensor):
        transitions = list(transitions.unbind(0))
    return apply_in_order(start, transitions, listed, kind)


def compose_batched(
    start: torch.Tensor | None,
    transitions: torch.Tensor | None,
    states: torch.Tensor,
    counts: Sequence[int],
    kind: str,
    *,
    store_steps: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """N requests' states advanced over their own runs of maps (contract of `naive_compose` with `counts`):
    start [N, *state_shape] or None (zeros), transitions [M, ...] or None, states [M, *state_shape]; with
    `store_steps` also the state after every map (the seam start-state scan). Float32 results."""
    probe = states if states.shape[0] or start is None else start
    if probe.shape[0] and select_backend(probe[0], kind, backend) == "triton":
        return _triton_batched(start, transitions, states, counts, kind, store_steps)
    if store_steps:
        return naive_compose(start, transitions, states, counts, kind=kind, store_steps=True)
    counts = [int(count) for count in counts]
    ends, first = [], 0
    for request, count in enumerate(counts):
        begin = states.new_zeros(states.shape[1:], dtype=torch.float32) if start is None else start[request]
        ends.append(compose_in_order(
            begin, None if transitions is None else transitions[first : first + count], states[first : first + count],
            kind, backend="torch",
        ))
        first += count
    if not ends:
        return states.new_zeros((0, *states.shape[1:]), dtype=torch.float32)
    return torch.stack(ends)
