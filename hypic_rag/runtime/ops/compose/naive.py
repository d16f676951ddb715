"""Float32 reference of composing cached affine maps: S <- P_k . (... (P_1 . S + Z_1) ...) + Z_k, map by map.

Slow and plain (one `SegmentState.apply` per map); the ground truth the Triton kernels and the torch fold
(`segment_state.apply_in_order`) are tested against, for every transition kind ("matrix", "vector", "scalar").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hypic_rag.runtime.segment_state import SegmentState


def naive_compose(
    start: torch.Tensor | None, transitions: torch.Tensor | None, states: torch.Tensor,
    counts: Sequence[int] | None = None, *, kind: str = "matrix", store_steps: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Advance each request's start state over its own run of maps, in order.

    Args:
        start: [N, *state_shape] (or [*state_shape] when `counts` is None: one request); None: zeros.
        transitions: [M, *transition_shape] of `kind` (None: the identity, the `addition` baseline).
        states: [M, *state_shape]; request n's maps are rows sum(counts[:n]) .. sum(counts[:n+1]) - 1.
        counts: maps per request (summing to M); None: one request with all M maps.
        store_steps: also return the state after every map.
    Returns:
        end states [N, *state_shape] ([*state_shape] for one request), and with `store_steps` the state after
        every map [M, *state_shape]; float32.
    """
    single = counts is None
    counts = [states.shape[0]] if single else [int(count) for count in counts]
    if start is None:
        start = states.new_zeros((len(counts), *states.shape[1:]), dtype=torch.float32)
    elif single:
        start = start[None]
    ends: list[torch.Tensor] = []
    steps: list[torch.Tensor] = []
    first = 0
    for request, count in enumerate(counts):
        state = start[request].float()
        for index in range(first, first + count):
            if transitions is None:
                state = state + states[index].float()
            else:
                state = SegmentState(transitions[index], states[index], kind).apply(state)
            steps.append(state)
        ends.append(state)
        first += count
    end = torch.stack(ends)[0] if single else torch.stack(ends)
    if not store_steps:
        return end
    return end, (torch.stack(steps) if steps else states.new_zeros(states.shape, dtype=torch.float32))
