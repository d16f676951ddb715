"""Blocked selective scan in torch: Mamba1 without a Python step per token, exact up to float32 round-off.

The sequence is cut into blocks of C tokens. Inside a block every (channel, state) pair is an independent scalar
recurrence h_t = e_t h_{t-1} + u_t with e_t = exp(dt_t a) and u_t = dt_t x_t b_t, so the block's affine maps
(e, u) are composed by a log-depth inclusive scan (Hillis-Steele: log2 C steps over the whole block at once),
giving each token's zero-start state U_t and decay product E_t from the block start; the real states are
E_t S + U_t with S the state entering the block, the outputs sum_n (E_t S + U_t) c_t, and the block hands on
its last state. Only products of decays (each <= 1) are formed, never their inverses, so strong decays cannot
overflow. Memory is one block's [batch, D, C, N] at a time. Tokens with dt = 0 and x = 0 leave the state as is, so
right-padding a batch with them gives every row its own final state.
"""

from __future__ import annotations

import torch

from hypic_rag.runtime.ops.selective_scan.naive import check_selective_scan_shapes

DEFAULT_BLOCK_SIZE = 32


def compose_prefixes(decay: torch.Tensor, update: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive scan of affine maps h -> decay_t h + update_t along dim -2 (time), in log2(T) steps.

    Args:
        decay, update: [..., T, N].
    Returns:
        (E, U) [..., T, N]: E_t = decay_t ... decay_0 and U_t the state at t from a zero start.
    """
    length = decay.shape[-2]
    offset = 1
    while offset < length:
        carried = decay[..., offset:, :] * update[..., :-offset, :] + update[..., offset:, :]
        update = torch.cat([update[..., :offset, :], carried], dim=-2)
        decay = torch.cat([decay[..., :offset, :], decay[..., offset:, :] * decay[..., :-offset, :]], dim=-2)
        offset *= 2
    return decay, update


def blocked_selective_scan(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocked selective scan; same contract as `naive_selective_scan`.

    Args:
        x, dt: [batch, D, T]; a: [D, N]; b, c: [batch, T, N]; d: [D] or None; initial_state: [batch, D, N] or None.
    Returns:
        output [batch, D, T] and final state [batch, D, N], float32.
    """
    check_selective_scan_shapes(x, dt, a, b, c)
    x, dt, a, b, c = (t.float() for t in (x, dt, a, b, c))
    batch, channels, length = x.shape
    state = (
        torch.zeros(batch, channels, a.shape[1], dtype=torch.float32, device=x.device)
        if initial_state is None
        else initial_state.float()
    )
    output = torch.empty(batch, channels, length, dtype=torch.float32, device=x.device)
    weighted_input = dt * x  # [batch, D, T]
    for begin in range(0, length, block_size):
        end = min(begin + block_size, length)
        decay = torch.exp(dt[:, :, begin:end, None] * a[:, None, :])  # [batch, D, C, N]
        update = weighted_input[:, :, begin:end, None] * b[:, None, begin:end]
        products, zero_start = compose_prefixes(decay, update)
        states = torch.addcmul(zero_start, products, state[:, :, None, :])
        output[:, :, begin:end] = (states * c[:, None, begin:end]).sum(-1)
        state = states[:, :, -1]
    if d is not None:
        output = output + d.float()[None, :, None] * x
    return output, state if length else state.clone()
