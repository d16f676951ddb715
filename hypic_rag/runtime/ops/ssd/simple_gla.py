"""SSD as scalar-decay linear attention, for fla's simple-GLA kernels on CUDA.

Per head, S_t = exp(dt_t a_h) S_{t-1} + dt_t b_t x_t^T and y_t = S_t^T c_t + d_h x_t is simple GLA
(S_t = exp(g_t) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t) with q = c, k = dt b, v = x, g = dt a (b and c repeated from
their G groups to the H heads), plus the d x skip: the state layout [N, P] is fla's [K, V].
"""

from __future__ import annotations

import torch

from hypic_rag.runtime.ops.ssd.naive import check_ssd_shapes, expand_groups


def ssd_through_simple_gla(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None, *, recurrent: bool = False, cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contract of `naive_ssd` (x [batch, H, T, P], dt [batch, H, T], a [H], b, c [batch, G, T, N], d [H] or None,
    initial_state [S, H, N, P] or None) through fla's chunked simple GLA (`recurrent`: its fused recurrent kernel);
    `cu_seqlens` [S + 1] for sequences packed along T in a batch of one. Returns output [batch, H, T, P] and final
    states [S, H, N, P], float32."""
    from hypic_rag.kernels import simple_gla

    check_ssd_shapes(x, dt, a, b, c)
    heads = x.shape[1]
    dt = dt.float()
    query = expand_groups(c.float(), heads)
    key = expand_groups(b.float(), heads) * dt[..., None]
    log_decay = dt * a.float()[None, :, None]
    run = simple_gla.fla_fused_recurrent_simple_gla if recurrent else simple_gla.fla_chunk_simple_gla
    output, final = run(query, key, x.float(), log_decay, initial_state, cu_seqlens)
    if d is not None:
        output = output + d.float()[None, :, None, None] * x.float()
    return output, final
