"""Mixer paths re-implemented over the model's own modules, exposing what composition needs.

Shapes drop the batch dimension (one request at a time): T tokens, H heads. The projections, the convolution and
the output paths also take leading batch dimensions ([..., T, hidden]); the training forward of
`training/block_layout.py` runs them batched.
- Gated DeltaNet (linear_attention): pre-conv projections, short causal conv with an explicit left context
  (the conv tail), gated-delta-rule inputs, and the gated output norm + projection.
- Gated full attention: pre-RoPE (k-normed) keys, rotary for arbitrary positions (partial rotary and M-RoPE
  sections as the model's rotary embedding computes them), causal attention by sequence index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(slots=True)
class LinearMixerInputs:
    """Inputs of the gated delta rule for T tokens.

    query, key: [H, T, K] (l2-normalised; query also scaled by K^-1/2); value: [H, T, V];
    log_decay, beta: [H, T]; output_gate: [T, H, V] (the z branch); preconv: [T, C] (conv inputs, C = conv dim).
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    log_decay: torch.Tensor
    beta: torch.Tensor
    output_gate: torch.Tensor
    preconv: torch.Tensor


def conv_kernel_size(mixer: nn.Module) -> int:
    return int(mixer.conv_kernel_size)


def empty_conv_tail(mixer: nn.Module, device: torch.device) -> torch.Tensor:
    """Zero conv context [C, kernel-1] (what a standalone span sees)."""
    return torch.zeros(mixer.conv_dim, conv_kernel_size(mixer) - 1, dtype=torch.float32, device=device)


def advance_conv_tail(tail: torch.Tensor, preconv: torch.Tensor) -> torch.Tensor:
    """Last kernel-1 conv inputs after appending `preconv` [T, C] to `tail` [C, kernel-1]."""
    width = tail.shape[-1]
    if width == 0:
        return tail
    recent = preconv[-width:].float().transpose(0, 1)  # only the last inputs can reach the tail
    return torch.cat([tail, recent], dim=1)[:, -width:].contiguous()


def _project(mixer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., T, hidden] -> preconv [..., T, C], z [..., T, H, V], b [..., T, H], a [..., T, H] for either layout."""
    if hasattr(mixer, "in_proj_qkvz"):  # Qwen3-Next: grouped qkvz / ba layout (its own code wants a batch dim)
        batched = x if x.dim() == 3 else x[None]
        query, key, value, z, b, a = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(batched), mixer.in_proj_ba(batched))
        preconv = torch.cat([t.reshape(*t.shape[:2], -1) for t in (query, key, value)], dim=-1)
        return (preconv, z, b, a) if x.dim() == 3 else (preconv[0], z[0], b[0], a[0])
    preconv = mixer.in_proj_qkv(x)
    z = mixer.in_proj_z(x).reshape(*x.shape[:-1], -1, mixer.head_v_dim)
    return preconv, z, mixer.in_proj_b(x), mixer.in_proj_a(x)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def linear_projections(mixer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-local projections of x [..., T, hidden] (no context needed, so done once for all recomputed tokens):
    preconv [..., T, C], output gate z [..., T, H, V], b [..., T, H], a [..., T, H]."""
    return _project(mixer, x)


def short_convolution(mixer: nn.Module, preconv: torch.Tensor, conv_context: torch.Tensor) -> torch.Tensor:
    """The short causal conv and its SiLU over n runs: preconv [n, T, C], each run with its own left context
    conv_context [n, C, kernel-1]. Returns the convolved q/k/v channels [n, T, C]."""
    weight = mixer.conv1d.weight  # [C, 1, kernel]
    conv_input = torch.cat([conv_context.to(weight.dtype), preconv.transpose(1, 2).to(weight.dtype)], dim=2)
    return F.silu(F.conv1d(conv_input, weight, mixer.conv1d.bias, groups=conv_input.shape[1])).transpose(1, 2)


def split_delta_rule_inputs(
    mixer: nn.Module, convolved: torch.Tensor, b: torch.Tensor, a: torch.Tensor, lengths: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Delta-rule inputs from convolved channels [n, T, C] and b, a [n, T, H]: query, key [n, H, T, K]
    (l2-normalised, query scaled by K^-1/2), value [n, H, T, V], log_decay, beta [n, H, T]. Positions at or past a
    run's length (when `lengths` is given) get log_decay = 0 and beta = 0: identity steps that leave the state alone."""
    runs, length, _ = convolved.shape
    query, key, value = torch.split(convolved, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    heads_v, heads_k = mixer.num_v_heads, mixer.num_k_heads
    query = query.reshape(runs, length, heads_k, mixer.head_k_dim).float()
    key = key.reshape(runs, length, heads_k, mixer.head_k_dim).float()
    value = value.reshape(runs, length, heads_v, mixer.head_v_dim).float()
    if heads_v != heads_k:
        query = query.repeat_interleave(heads_v // heads_k, dim=2)
        key = key.repeat_interleave(heads_v // heads_k, dim=2)
    query = _l2norm(query) * (mixer.head_k_dim**-0.5)
    key = _l2norm(key)
    beta = b.float().sigmoid()
    log_decay = -mixer.A_log.float().exp() * F.softplus(a.float() + mixer.dt_bias)
    if lengths is not None:
        valid = (torch.arange(length, device=convolved.device)[None, :] < torch.tensor(lengths, device=convolved.device)[:, None]).float()
        beta = beta * valid[..., None]
        log_decay = log_decay * valid[..., None]
    return (
        query.transpose(1, 2).contiguous(),
        key.transpose(1, 2).contiguous(),
        value.transpose(1, 2).contiguous(),
        log_decay.transpose(1, 2).contiguous(),
        beta.transpose(1, 2).contiguous(),
    )


def batched_delta_rule_inputs(
    mixer: nn.Module,
    preconv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_context: torch.Tensor,
    lengths: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Short causal conv and delta-rule inputs of n runs at once, each with its own left context.

    preconv [n, T, C] (runs zero-padded at the end), b, a [n, T, H], conv_context [n, C, kernel-1].
    Returns query, key [n, H, T, K], value [n, H, T, V], log_decay, beta [n, H, T] (see `split_delta_rule_inputs`).
    """
    return split_delta_rule_inputs(mixer, short_convolution(mixer, preconv, conv_context), b, a, lengths)


def delta_rule_inputs(
    mixer: nn.Module,
    preconv: torch.Tensor,
    output_gate: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_context: torch.Tensor,
) -> LinearMixerInputs:
    """One contiguous run: preconv [T, C], output_gate [T, H, V], b, a [T, H], conv_context [C, kernel-1]."""
    query, key, value, log_decay, beta = batched_delta_rule_inputs(mixer, preconv[None], b[None], a[None], conv_context[None])
    return LinearMixerInputs(query[0], key[0], value[0], log_decay[0], beta[0], output_gate, preconv)


def linear_mixer_inputs(mixer: nn.Module, x: torch.Tensor, conv_context: torch.Tensor) -> LinearMixerInputs:
    """Project, convolve (with `conv_context` [C, kernel-1] as the left context) and split for the delta rule.

    x: [T, hidden] (already input-normalised), one contiguous run.
    """
    return delta_rule_inputs(mixer, *linear_projections(mixer, x), conv_context)


def linear_mixer_output(mixer: nn.Module, core: torch.Tensor, output_gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gated RMS norm and output projection: core [..., H, T, V], output_gate [..., T, H, V] -> [..., T, hidden]."""
    *lead, heads, length, value_dim = core.shape
    core = core.transpose(-3, -2).reshape(-1, value_dim).to(dtype)
    normed = mixer.norm(core, output_gate.reshape(-1, value_dim))
    return mixer.out_proj(normed.reshape(*lead, length, heads * value_dim))


# ---------------------------------------------------------------------------------------------- attention


def attention_inputs(attention: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., T, hidden] -> query [..., Hq, T, D] (normed, pre-RoPE), key [..., Hkv, T, D] (normed, pre-RoPE),
    value [..., Hkv, T, D], output gate [..., T, Hq*D] (or an empty tensor when the layer has no gate)."""
    tokens, head_dim = x.shape[:-1], attention.head_dim
    projected = attention.q_proj(x)
    heads_q = attention.config.num_attention_heads
    if projected.shape[-1] == heads_q * head_dim * 2:  # gated attention (Qwen3.5 / Qwen3-Next)
        query, gate = torch.chunk(projected.view(*tokens, heads_q, head_dim * 2), 2, dim=-1)
        gate = gate.reshape(*tokens, -1)
    else:
        query, gate = projected.view(*tokens, heads_q, head_dim), projected.new_empty(0)
    query = attention.q_norm(query).transpose(-3, -2)
    key = attention.k_norm(attention.k_proj(x).view(*tokens, -1, head_dim)).transpose(-3, -2)
    value = attention.v_proj(x).view(*tokens, -1, head_dim).transpose(-3, -2)
    return query, key, value, gate


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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first R dims of x [H, T, D] (half-split convention); the rest pass through (partial rotary)."""
    rotary_dim = cos.shape[-1]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    turned = torch.cat([-rotated[..., half:], rotated[..., :half]], dim=-1)
    out = rotated * cos.to(x.dtype) + turned * sin.to(x.dtype)
    return torch.cat([out, passed], dim=-1)


def attention_core(
    attention: nn.Module,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_index: torch.Tensor,
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
    out = F.scaled_dot_product_attention(
        query[None], keys[None].to(query.dtype), values[None].to(query.dtype), attn_mask=mask,
        is_causal=plain_causal, scale=attention.scaling, enable_gqa=groups > 1,
    )[0]  # [Hq, Tq, D]
    return out.transpose(0, 1).reshape(query.shape[1], -1)


def causal_attention(attention: nn.Module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Plain causal attention of sequences that each start at position 0: query [n, Hq, T, D] (rotated), keys /
    values [n, Hkv, T, D]. Returns [n, T, Hq*D] in the query dtype."""
    groups = query.shape[1] // keys.shape[1]
    out = F.scaled_dot_product_attention(
        query, keys.to(query.dtype), values.to(query.dtype), is_causal=True, scale=attention.scaling,
        enable_gqa=groups > 1,
    )  # [n, Hq, T, D]
    return out.transpose(1, 2).reshape(query.shape[0], query.shape[2], -1)


def attention_output(attention: nn.Module, core: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Output gate and projection: core [T, Hq*D] -> [T, hidden]."""
    if gate.numel():
        core = core * torch.sigmoid(gate)
    return attention.o_proj(core)


def mlp_forward(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's MLP or MoE block on x [T, hidden] or [n, T, hidden] (MoE blocks may return (out, router_logits))."""
    batched = x.dim() == 3
    out = layer.mlp(x if batched else x[None])
    if isinstance(out, tuple):
        out = out[0]
    return out if batched else out[0]
