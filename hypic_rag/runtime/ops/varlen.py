"""Sequences packed along time (`cu_seqlens`), each from its own start state: the checks and the per-sequence loop
that the head-major ops (gated delta rule, KDA, SSD, lightning) run where no varlen kernel does (CPU, or fla off)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch


def check_cu_seqlens(cu_seqlens: Sequence[int] | torch.Tensor, total: int, batch: int) -> list[int]:
    """The sequence bounds as ints: 0 .. total, non-decreasing, for a batch of one packed row."""
    bounds = [int(v) for v in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    if batch != 1 or not bounds or bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"cu_seqlens {bounds} must run from 0 to the {total} packed tokens of a batch of one")
    if any(later < earlier for earlier, later in itertools.pairwise(bounds)):
        raise ValueError(f"cu_seqlens {bounds} must be non-decreasing")
    return bounds


def check_start_states(initial_state: torch.Tensor | None, bounds: list[int]) -> None:
    if initial_state is not None and initial_state.shape[0] != len(bounds) - 1:
        raise ValueError(f"{initial_state.shape[0]} start states for {len(bounds) - 1} sequences")


def packed_bounds(cu_seqlens: Sequence[int] | torch.Tensor, packed: torch.Tensor,
                  initial_state: torch.Tensor | None) -> list[int]:
    """The checked bounds of sequences packed along dim 2 of `packed` [1, H, T, ...], one start state each."""
    bounds = check_cu_seqlens(cu_seqlens, packed.shape[2], packed.shape[0])
    check_start_states(initial_state, bounds)
    return bounds


def fla_backend(select: Callable[[torch.Tensor, int], str], packed: torch.Tensor, bounds: list[int]) -> str | None:
    """"fla" / "fla_recurrent" when the op's `select(packed, longest sequence)` picks fla for these sequences and
    every sequence has a token (what fla's varlen kernels take); None: the per-sequence loop."""
    if packed.shape[2] == 0 or any(end <= begin for begin, end in itertools.pairwise(bounds)):
        return None
    backend = select(packed, max(end - begin for begin, end in itertools.pairwise(bounds)))
    return backend if backend in ("fla", "fla_recurrent") else None


def offsets(bounds: list[int], device: torch.device) -> torch.Tensor:
    """`cu_seqlens` as fla takes it: int64 on the tensors' device."""
    return torch.tensor(bounds, dtype=torch.long, device=device)


def each_sequence(
    run: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    timed: Sequence[torch.Tensor],
    bounds: list[int],
    initial_state: torch.Tensor | None,
    output_shape: tuple[int, ...],
    state_shape: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed sequences one at a time: sequence n (time steps bounds[n] .. bounds[n+1] - 1) through
    `run(*[x[:, :, begin:end] for x in timed], start [1, *state] or None)` -> (outputs [1, H, end - begin, ...],
    final [1, *state]), written into a float32 output of `output_shape` [1, H, T, ...] (time on dim 2). An empty
    sequence keeps its start state (zeros without one). Returns (output [*output_shape], finals [S, *state])."""
    device = timed[0].device
    output = torch.zeros(*output_shape, dtype=torch.float32, device=device)
    finals = []
    for number, (begin, end) in enumerate(itertools.pairwise(bounds)):
        start = None if initial_state is None else initial_state[number : number + 1]
        if end == begin:
            finals.append(torch.zeros(1, *state_shape, dtype=torch.float32, device=device)
                          if start is None else start.float().clone())
            continue
        output[:, :, begin:end], final = run(*(x[:, :, begin:end] for x in timed), start)
        finals.append(final)
    if not finals:
        return output, torch.zeros(0, *state_shape, dtype=torch.float32, device=device)
    return output, torch.cat(finals)
