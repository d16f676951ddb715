"""Composition of cached affine maps in one Triton launch: S <- P_k(...(P_2 (P_1 S + Z_1) + Z_2)...) + Z_k.

A linear layer's running state S [H, K, V] advances over k cached chunks, chunk i holding its transition
P_i [H, K, K] and zero-start state Z_i [H, K, V] (docs/design.md). The kernel keeps a [K, BLOCK_V] slab of S in
registers in float32 for one (request, head, value block) and walks the chunks in order, reading each P_i / Z_i once
in its storage dtype (float32, float16 or bfloat16) and accumulating in float32: 3xTF32 tensor-core products, within
a few 1e-7 of float32 (plain float32 FMA dots spilled registers at K = 128 when compiled for sm_90).

- `compose_affine`: one request. `compose_affine_batched`: many requests in one launch, each with its own start
  state and its own run of maps (given by per-request counts, laid out one request after another).
- `store_steps=True` also returns the state after every map: the seam start-state scan (the state each recomputed
  seam starts from is the state after the maps before it).
- `transitions=None` is the `addition` baseline (P = I: S <- S + Z_1 + ... + Z_k).
The float32 reference the tests hold the kernel to is `hypic_rag.runtime.ops.compose.naive_compose`; the
runtime reaches this module only through `hypic_rag.runtime.ops.compose` (the ops registry).

Under `TRITON_INTERPRET=1` the kernel runs on CPU tensors (tests: float32 / float16; the interpreter mishandles
bfloat16). The interpreter cannot take a loop bound from a runtime value, so the bound is a constexpr (`runs.py`); each
program skips the steps past its own request's count. Block sizes are chosen from the shapes rather than autotuned: one compile per
shape keeps the first request (and the GPU check) fast, and the interpreter has no autotuner.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from hypic_rag.kernels.runs import request_runs, strides


@triton.jit
def _compose_kernel(
    start_ptr, transition_ptr, state_ptr, out_ptr, steps_ptr, first_ptr, count_ptr, K, V, stride_start_n,
    stride_start_h, stride_start_k, stride_start_v, stride_p_m, stride_p_h, stride_p_r, stride_p_c, stride_z_m,
    stride_z_h, stride_z_k, stride_z_v, stride_out_n, stride_out_h, stride_out_k, stride_out_v, stride_steps_m,
    stride_steps_h, stride_steps_k, stride_steps_v, MAX_COUNT: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, HAS_TRANSITION: tl.constexpr, HAS_START: tl.constexpr, STORE_STEPS: tl.constexpr,
):
    request = tl.program_id(0)
    head = tl.program_id(1)
    value_block = tl.program_id(2)
    first = tl.load(first_ptr + request)  # int64: offsets never overflow
    count = tl.load(count_ptr + request)
    rows = tl.arange(0, BLOCK_K)
    cols = value_block * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < K
    slab_ok = row_ok[:, None] & (cols < V)[None, :]
    square_ok = row_ok[:, None] & row_ok[None, :]

    if HAS_START:
        start = start_ptr + request * stride_start_n + head * stride_start_h
        state = tl.load(
            start + rows[:, None] * stride_start_k + cols[None, :] * stride_start_v, mask=slab_ok, other=0.0
        ).to(tl.float32)
    else:
        state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)

    for step in range(MAX_COUNT):
        if step < count:
            index = first + step
            z = tl.load(
                state_ptr + index * stride_z_m + head * stride_z_h
                + rows[:, None] * stride_z_k + cols[None, :] * stride_z_v,
                mask=slab_ok,
                other=0.0,
            ).to(tl.float32)
            if HAS_TRANSITION:
                p = tl.load(
                    transition_ptr + index * stride_p_m + head * stride_p_h
                    + rows[:, None] * stride_p_r + rows[None, :] * stride_p_c,
                    mask=square_ok,
                    other=0.0,
                ).to(tl.float32)
                state = tl.dot(p, state, input_precision="tf32x3") + z
            else:
                state = state + z
            if STORE_STEPS:
                tl.store(
                    steps_ptr + index * stride_steps_m + head * stride_steps_h
                    + rows[:, None] * stride_steps_k + cols[None, :] * stride_steps_v,
                    state,
                    mask=slab_ok,
                )

    out = out_ptr + request * stride_out_n + head * stride_out_h
    tl.store(out + rows[:, None] * stride_out_k + cols[None, :] * stride_out_v, state, mask=slab_ok)


def compose_affine_batched(
    start: torch.Tensor | None, transitions: torch.Tensor | None, states: torch.Tensor, counts: Sequence[int], *,
    store_steps: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Advance N requests' states over their own runs of maps, in one launch.

    start: [N, H, K, V] (any float dtype, any strides; None: zeros). transitions: [M, H, K, K] or None (P = I);
    states: [M, H, K, V]; request n's maps are rows sum(counts[:n]) .. sum(counts[:n+1]) - 1 of both (storage dtype
    float32 / float16 / bfloat16). counts: N non-negative ints summing to M.
    Returns end states [N, H, K, V] float32, and with `store_steps` also the state after every map [M, H, K, V]
    float32 (row i: the state of its request right after map i).
    """
    maps, heads, key_dim, value_dim = states.shape
    runs = request_runs(counts, maps, states.device)
    if transitions is not None and tuple(transitions.shape) != (maps, heads, key_dim, key_dim):
        raise ValueError(f"transitions {tuple(transitions.shape)} do not match states {tuple(states.shape)}")
    requests = len(runs.counts)
    if start is not None and tuple(start.shape) != (requests, heads, key_dim, value_dim):
        raise ValueError(f"start {tuple(start.shape)} does not match {requests} requests of {tuple(states.shape[1:])}")
    device = states.device
    out = torch.empty(requests, heads, key_dim, value_dim, dtype=torch.float32, device=device)
    steps = torch.empty(maps, heads, key_dim, value_dim, dtype=torch.float32, device=device) if store_steps else None
    if requests == 0:
        return (out, steps) if store_steps else out
    block_k = max(16, triton.next_power_of_2(key_dim))
    block_v = 16 if value_dim <= 16 else 32
    grid = (requests, heads, triton.cdiv(value_dim, block_v))
    _compose_kernel[grid](
        start if start is not None else out,
        transitions if transitions is not None else states,
        states,
        out,
        steps if steps is not None else out,
        runs.first,
        runs.count,
        key_dim,
        value_dim,
        *strides(start, 4),
        *strides(transitions, 4),
        *states.stride(),
        *out.stride(),
        *strides(steps, 4),
        MAX_COUNT=runs.max_count,
        BLOCK_K=block_k,
        BLOCK_V=block_v,
        HAS_TRANSITION=transitions is not None,
        HAS_START=start is not None,
        STORE_STEPS=store_steps,
        num_warps=4 if block_k <= 64 else 8,
    )
    return (out, steps) if store_steps else out


def compose_affine(
    start: torch.Tensor | None, transitions: torch.Tensor | None, states: torch.Tensor, *, store_steps: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One request: start [H, K, V] (None: zeros) advanced over maps transitions [k, H, K, K] (None: P = I) and
    states [k, H, K, V], in order. Returns the end state [H, K, V] float32 (and every step's state [k, H, K, V])."""
    result = compose_affine_batched(
        None if start is None else start[None], transitions, states, [states.shape[0]], store_steps=store_steps
    )
    if store_steps:
        end, steps = result
        return end[0], steps
    return result[0]
