"""Step-by-step gated delta rule for a handful of tokens (decode): no chunk padding, no triangular solves.

Same contract and mathematics as `naive.recurrent` (the reference), written for speed at T of 1-4: the state is
updated in place with batched matrix products. Longer inputs belong to `chunk.py`. `gated_delta_rule_step`: ONE
token of n sequences, q / k with the model's key heads (repeated over their value heads inside), what a CPU decode
step runs (`GatedDeltaNetMixer.step`).
"""

from __future__ import annotations

import torch

from hypic_rag.runtime.ops.step_rows import head_rows, joined_outputs, start_rows


def fused_recurrent_gated_delta_rule(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """query, key [B, H, T, K]; value [B, H, T, V]; log_decay, beta [B, H, T]; initial_state [B, H, K, V] or None.

    Returns output [B, H, T, V] and the final state [B, H, K, V], float32 (the input state is not modified).
    """
    state = start_rows(key, value, initial_state)
    query_rows, key_rows, value_rows = head_rows(query, key, value)
    decay = log_decay.float().flatten(0, 1).exp()  # [B*H, T]
    strength = beta.float().flatten(0, 1)
    outputs = []
    for t in range(key.shape[2]):
        k_t = key_rows[:, t : t + 1]  # [BH, 1, K]
        state.mul_(decay[:, t, None, None])
        error = value_rows[:, t : t + 1] - torch.bmm(k_t, state)  # [BH, 1, V]
        state.baddbmm_(k_t.transpose(1, 2), error * strength[:, t, None, None])
        outputs.append(torch.bmm(query_rows[:, t : t + 1], state))
    return joined_outputs(outputs, state, key, value)


def gated_delta_rule_step(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of n sequences: query, key [n, Hk, K] (normalised and scaled as the model wants), value [n, Hv, V],
    log_decay, beta [n, Hv], state [n, Hv, K, V]; value head h reads key head h // (Hv / Hk) (GQA: what
    `repeat_interleave` of q and k over the heads gives). Returns output [n, Hv, V] (o = S^T q after the update)
    and the new state [n, Hv, K, V], float32; `state` is not modified.

    The same values as `naive_recurrent_gated_delta_rule` over T = 1 with repeated q / k heads (float32 round-off;
    tests/runtime/test_decode_step.py): the decayed state is a new tensor updated in place, one batched product
    per read and one per write."""
    batch, key_heads, key_dim = key.shape
    value_heads, value_dim = value.shape[1], value.shape[2]
    rows = batch * value_heads
    if value_heads != key_heads:
        query = query.repeat_interleave(value_heads // key_heads, dim=1)
        key = key.repeat_interleave(value_heads // key_heads, dim=1)
    k_t = key.float().reshape(rows, 1, key_dim)
    updated = state.float().reshape(rows, key_dim, value_dim) * log_decay.float().exp().reshape(rows, 1, 1)
    error = value.float().reshape(rows, 1, value_dim) - torch.bmm(k_t, updated)  # v - S^T k
    correction = error * beta.float().reshape(rows, 1, 1)
    updated.baddbmm_(k_t.transpose(1, 2), correction)  # + k (beta (v - S^T k))^T
    output = torch.bmm(query.float().reshape(rows, 1, key_dim), updated)
    return output.view(batch, value_heads, value_dim), updated.view(batch, value_heads, key_dim, value_dim)
