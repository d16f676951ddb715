"""Composition of cached affine maps with an ELEMENTWISE transition in one Triton launch: S <- P . S + Z, map by map.

The kinds besides the delta rules' matrix P (docs/design.md, section 2; `runtime/segment_state.py`):
- "scalar": one decay per head, P [H, 1, 1] on a state [H, K, V] (SSD / Mamba2, lightning, simple GLA);
- "vector": an elementwise decay, P shaped like the state (Mamba1's [D, N]) or broadcast along some dims
  (a per-key-channel gate [H, K, 1]).
One kernel serves both: P is read through strides that are 0 along its broadcast dims, so a scalar P costs one
load per head and map, not a state-sized tensor. The state of one (request, group of the leading dim, block of
elements) stays in registers in float32 while the program walks its request's maps in order, reading each P / Z
once in its storage dtype (float32, float16, bfloat16). States are [G, R, C] (rank 3) or [R, C] (rank 2).

`compose_elementwise_batched` has the contract of `hypic_rag.runtime.ops.compose.naive_compose` for these kinds
(counts per request, `store_steps` for the state after every map, `transitions=None` for the `addition` baseline);
the runtime reaches it only through `hypic_rag.runtime.ops.compose`. Under `TRITON_INTERPRET=1` it runs on CPU
tensors (float32 / float16; the interpreter mishandles bfloat16).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from hypic_rag.kernels.runs import request_runs, strides

BLOCK = 1024
"""State elements per program: enough work per program for large states, few programs per head for small ones."""


@triton.jit
def _compose_elementwise_kernel(
    start_ptr, transition_ptr, state_ptr, out_ptr, steps_ptr, first_ptr, count_ptr, ROWS, COLS, stride_start_n,
    stride_start_g, stride_start_r, stride_start_c, stride_p_m, stride_p_g, stride_p_r, stride_p_c, stride_z_m,
    stride_z_g, stride_z_r, stride_z_c, stride_out_n, stride_out_g, stride_out_r, stride_out_c, stride_steps_m,
    stride_steps_g, stride_steps_r, stride_steps_c, MAX_COUNT: tl.constexpr, BLOCK_E: tl.constexpr,
    HAS_TRANSITION: tl.constexpr, HAS_START: tl.constexpr, STORE_STEPS: tl.constexpr,
):
    request = tl.program_id(0)
    group = tl.program_id(1)
    elements = tl.program_id(2) * BLOCK_E + tl.arange(0, BLOCK_E)
    ok = elements < ROWS * COLS
    row = elements // COLS
    col = elements % COLS
    first = tl.load(first_ptr + request)  # int64: offsets never overflow
    count = tl.load(count_ptr + request)

    if HAS_START:
        start = start_ptr + request * stride_start_n + group * stride_start_g
        state = tl.load(start + row * stride_start_r + col * stride_start_c, mask=ok, other=0.0).to(tl.float32)
    else:
        state = tl.zeros([BLOCK_E], dtype=tl.float32)

    for step in range(MAX_COUNT):
        if step < count:
            index = first + step
            z = tl.load(
                state_ptr + index * stride_z_m + group * stride_z_g + row * stride_z_r + col * stride_z_c,
                mask=ok,
                other=0.0,
            ).to(tl.float32)
            if HAS_TRANSITION:
                p = tl.load(
                    transition_ptr + index * stride_p_m + group * stride_p_g + row * stride_p_r + col * stride_p_c,
                    mask=ok,
                    other=0.0,
                ).to(tl.float32)
                state = p * state + z
            else:
                state = state + z
            if STORE_STEPS:
                tl.store(
                    steps_ptr + index * stride_steps_m + group * stride_steps_g
                    + row * stride_steps_r + col * stride_steps_c,
                    state,
                    mask=ok,
                )

    out = out_ptr + request * stride_out_n + group * stride_out_g
    tl.store(out + row * stride_out_r + col * stride_out_c, state, mask=ok)


def _as_rank3(tensor: torch.Tensor) -> torch.Tensor:
    """[M, R, C] -> [M, 1, R, C] (a view); [M, G, R, C] as it is."""
    return tensor[:, None] if tensor.dim() == 3 else tensor


def _broadcast_strides(transitions: torch.Tensor, state_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of transitions [M, *P] read as [M, *state_shape]: 0 along every dim where P has size 1."""
    return (transitions.stride(0), *(0 if size == 1 else stride for size, stride in zip(
        transitions.shape[1:], transitions.stride()[1:])))


def compose_elementwise_batched(
    start: torch.Tensor | None, transitions: torch.Tensor | None, states: torch.Tensor, counts: Sequence[int], *,
    store_steps: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Advance N requests' states over their own runs of elementwise maps, in one launch.

    start: [N, *S] (S = [G, R, C] or [R, C]; any float dtype and strides; None: zeros). transitions: [M, *P] with
    P of S's rank, each dim 1 or S's (broadcast), or None (P = 1, the `addition` baseline); states: [M, *S];
    request n's maps are rows sum(counts[:n]) .. sum(counts[:n+1]) - 1 (storage dtype float32 / float16 / bfloat16).
    Returns end states [N, *S] float32, and with `store_steps` the state after every map [M, *S] float32.
    """
    state_shape = tuple(states.shape[1:])
    if len(state_shape) not in (2, 3):
        raise ValueError(f"states must be [M, G, R, C] or [M, R, C], got {tuple(states.shape)}")
    maps = states.shape[0]
    runs = request_runs(counts, maps, states.device)
    if transitions is not None:
        shape = tuple(transitions.shape)
        if (len(shape) != len(state_shape) + 1 or shape[0] != maps
                or any(size not in (1, full) for size, full in zip(shape[1:], state_shape))):
            raise ValueError(f"transitions {shape} do not broadcast to states {tuple(states.shape)}")
    requests = len(runs.counts)
    if start is not None and tuple(start.shape) != (requests, *state_shape):
        raise ValueError(f"start {tuple(start.shape)} does not match {requests} requests of {state_shape}")
    out = torch.empty(requests, *state_shape, dtype=torch.float32, device=states.device)
    steps = torch.empty(maps, *state_shape, dtype=torch.float32, device=states.device) if store_steps else None
    if requests == 0 or out.numel() == 0:
        return (out, steps) if store_steps else out
    groups, rows, cols = (1, *state_shape) if len(state_shape) == 2 else state_shape
    transition_strides = (0,) * 4
    if transitions is not None:
        transition_strides = _broadcast_strides(transitions, state_shape)
        if len(state_shape) == 2:
            transition_strides = (transition_strides[0], 0, *transition_strides[1:])
    block = min(BLOCK, max(16, triton.next_power_of_2(rows * cols)))
    grid = (requests, groups, triton.cdiv(rows * cols, block))
    _compose_elementwise_kernel[grid](
        start if start is not None else out,
        transitions if transitions is not None else states,
        states,
        out,
        steps if steps is not None else out,
        runs.first,
        runs.count,
        rows,
        cols,
        *strides(None if start is None else _as_rank3(start), 4),
        *transition_strides,
        *_as_rank3(states).stride(),
        *_as_rank3(out).stride(),
        *strides(None if steps is None else _as_rank3(steps), 4),
        MAX_COUNT=runs.max_count,
        BLOCK_E=block,
        HAS_TRANSITION=transitions is not None,
        HAS_START=start is not None,
        STORE_STEPS=store_steps,
        num_warps=4,
    )
    return (out, steps) if store_steps else out
