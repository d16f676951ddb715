"""Building blocks every mixer shares: conv tails, rotary tables and rotation, causal attention by sequence index,
and calling an MLP / MoE block.

Shapes drop the batch dimension where a function works on one request: T tokens, H heads. The family-specific
mixer paths live in `runtime/mixers/` (one module per mixer kind), built per model by `runtime/families/`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from hypic_rag.runtime.ops.rope import apply_rotary, rotate_into  # noqa: F401 (re-exported: L.apply_rotary, L.rotate_into)
from hypic_rag.runtime.threads import wide_for

if TYPE_CHECKING:
    from hypic_rag.runtime.mixers.base import AttentionMixer


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation transformers' `ACT2FN[name]` computes (a module's `activation`, read from its config's
    `hidden_act` or the like): `F.silu` for "silu" without importing transformers (the native build's), else
    transformers' own function. An unknown name raises ValueError."""
    if name == "silu":
        return F.silu
    from transformers.activations import ACT2FN  # here: importing this module must not import transformers

    try:
        return ACT2FN[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}") from None


def advance_conv_tail(tail: torch.Tensor, preconv: torch.Tensor) -> torch.Tensor:
    """Last kernel-1 conv inputs after appending `preconv` [T, C] to `tail` [C, kernel-1]."""
    width = tail.shape[-1]
    if width == 0:
        return tail
    recent = preconv[-width:].float().transpose(0, 1)  # only the last inputs can reach the tail
    return torch.cat([tail, recent], dim=1)[:, -width:].contiguous()


def causal_depthwise_conv(
    preconv: torch.Tensor, context: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The short depthwise causal conv of n runs, time-major: preconv [n, T, C], each run's left context [n, C, W]
    (W = kernel - 1), weight [C, 1, kernel], bias [C] or None. Returns [n, T, C] (contiguous, in weight's dtype).

    The same values as `F.conv1d(cat(context, preconv^T), weight, bias, groups=C)` transposed back (float32
    round-off apart; `tests/runtime/test_conv.py`), computed as `kernel` shifted multiply-adds over rows: no
    transposes: on CPU a depthwise conv1d over a few dozen rows of thousands of channels costs several times more
    than the multiply-adds (docs/runtime.md)."""
    kernel = weight.shape[-1]
    length = preconv.shape[1]
    taps = weight.reshape(weight.shape[0], kernel).t().contiguous()  # [kernel, C]: contiguous rows vectorise
    rows = torch.cat([context.transpose(1, 2).to(weight.dtype), preconv.to(weight.dtype)], dim=1)  # [n, W + T, C]
    first = rows[:, :length]
    out = first * taps[0] if bias is None else torch.addcmul(bias.to(weight.dtype), first, taps[0])
    for tap in range(1, kernel):
        out = torch.addcmul(out, rows[:, tap : tap + length], taps[tap])
    return out


def rotary_tables(rotary_embedding: nn.Module, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, R] for integer positions [T] as the model's rotary embedding computes them.

    A multimodal rotary module (M-RoPE: it has `mrope_section`) gets the same text position in each of its three
    streams, [3, 1, T], as the model's own forward passes them (transformers before 5.20 requires that layout; later
    ones also accept [1, T])."""
    position_ids = positions[None].to(like.device)
    if hasattr(rotary_embedding, "mrope_section"):
        position_ids = position_ids[None].expand(3, -1, -1)
    cos, sin = rotary_embedding(like, position_ids)
    return cos[0], sin[0]


def attention_core(
    attention: AttentionMixer, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_index: torch.Tensor,
    key_index: torch.Tensor,
) -> torch.Tensor:
    """Causal attention by sequence index, through `scaled_dot_product_attention` (flash kernels where they apply).

    query [Hq, Tq, D] (rotated), keys/values [Hkv, Tk, D] (rotated keys), query_index [Tq], key_index [Tk]:
    query i sees key j iff key_index[j] <= query_index[i]. Returns [Tq, Hq*D] in the query dtype. When the queries
    are exactly the keys' positions (a plain prefill) the causal flag replaces the mask; when every query sees every
    key (a decode step) there is no mask.
    """
    groups = query.shape[0] // keys.shape[0]
    plain_causal = query.shape[1] == keys.shape[1] and bool(torch.equal(query_index, key_index))
    sees_everything = bool(key_index.max() <= query_index.min())  # e.g. a decode step
    mask = None if plain_causal or sees_everything else key_index[None, :] <= query_index[:, None]
    # every thread for the attention itself inside a serial section when it is large (`runtime/threads.py`)
    with wide_for(query.shape[0] * query.shape[1] * keys.shape[1] * query.shape[2] * 2):
        out = F.scaled_dot_product_attention(
            query[None], keys[None].to(query.dtype), values[None].to(query.dtype), attn_mask=mask,
            is_causal=plain_causal, scale=attention.scaling, enable_gqa=groups > 1,
        )[0]  # [Hq, Tq, D]
    return out.transpose(0, 1).reshape(query.shape[1], -1)


def causal_attention(attention: AttentionMixer, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Plain causal attention of sequences that each start at position 0: query [n, Hq, T, D] (rotated), keys /
    values [n, Hkv, T, D]. Returns [n, T, Hq*D] in the query dtype."""
    groups = query.shape[1] // keys.shape[1]
    with wide_for(query.shape[0] * query.shape[1] * query.shape[2] * keys.shape[2] * query.shape[3]):  # causal: ~half
        out = F.scaled_dot_product_attention(
            query, keys.to(query.dtype), values.to(query.dtype), is_causal=True, scale=attention.scaling,
            enable_gqa=groups > 1,
        )  # [n, Hq, T, D]
    return out.transpose(1, 2).reshape(query.shape[0], query.shape[2], -1)


GATED_MLPS = frozenset({
    "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5MLP",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeMLP",
    "transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextMLP",
    "transformers.models.jamba.modeling_jamba.JambaMLP",
    "transformers.models.bamba.modeling_bamba.BambaMLP",
    "transformers.models.kimi_linear.modeling_kimi_linear.KimiLinearMLP",
    "transformers.models.olmo_hybrid.modeling_olmo_hybrid.OlmoHybridMLP",
    "hypic_rag.runtime.checkpoints.native.qwen3_5.GatedMLP",
})
"""MLP classes whose forward is exactly `down_proj(act_fn(gate_proj(x)) * up_proj(x))` (read in their source), so
that `fuse_gate_up` may compute it with gate and up as one `LinearGroup`."""

_GATE_UP = "_hypic_gate_up"


def fuse_gate_up(mlp: nn.Module | None) -> None:
    """Give a `GATED_MLPS` module of the runtime's view its gate and up projections as one `LinearGroup` (built once,
    when the blocks are built), which `call_mlp` then uses; other modules are left alone."""
    if mlp is None or f"{type(mlp).__module__}.{type(mlp).__qualname__}" not in GATED_MLPS:
        return
    from hypic_rag.runtime.fast_linear import LinearGroup

    group = LinearGroup([mlp.gate_proj, mlp.up_proj])
    if group.weight is not None:
        mlp.__dict__[_GATE_UP] = group


def call_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An MLP or MoE block on x [T, hidden] or [n, T, hidden] (MoE blocks may want a batch dim and may return
    (out, router_logits)). A gated MLP given its `fuse_gate_up` group computes down(act(gate(x)) * up(x)) with it
    (one product for one row; its module's own forward is the same arithmetic, layer by layer)."""
    gate_up = mlp.__dict__.get(_GATE_UP)
    if gate_up is not None:
        gate, up = gate_up(x)
        return mlp.down_proj(mlp.act_fn(gate) * up)
    batched = x.dim() == 3
    out = mlp(x if batched else x[None])
    if isinstance(out, tuple):
        out = out[0]
    return out if batched else out[0]
