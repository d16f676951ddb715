"""The linear mixers of kimi_linear, bailing_hybrid, olmo_hybrid and lfm2 rebuilt from their transformers modules'
weights on our ops, equal to the modules' own forward (fp32): the computations docs/families_linear.md describes.
(MiniMax's lightning mixer is checked the same way in test_lightning.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hypic_rag.runtime.ops.gated_delta_rule import (
    chunk_gated_delta_rule,
    gated_delta_rule,
    naive_recurrent_gated_delta_rule,
)
from hypic_rag.runtime.ops.kda import kda

TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


def randomise(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, 0.3)
    return module.eval()


def causal_conv(x: torch.Tensor, conv: torch.nn.Conv1d, tail: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal conv of x [B, T, C] with left context `tail` [B, kernel-1, C] (zeros when None)."""
    width = conv.weight.shape[-1] - 1
    if tail is None:
        tail = x.new_zeros(x.shape[0], width, x.shape[2])
    padded = torch.cat([tail, x], dim=1).transpose(1, 2)
    return F.conv1d(padded.to(conv.weight.dtype), conv.weight, conv.bias, groups=x.shape[2]).transpose(1, 2)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def head_major(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def kda_mixer(layer, hidden: torch.Tensor, family: str) -> torch.Tensor:
    """kimi_linear / bailing_hybrid linear layer: q|k|v projections, one causal conv + SiLU over all 3*H*K channels,
    per-channel gate, KDA, per-head RMS norm times sigmoid(output gate), output projection."""
    batch, length, _ = hidden.shape
    heads, head_dim = layer.num_heads, layer.head_dim
    mixed = torch.cat([layer.q_proj(hidden), layer.k_proj(hidden), layer.v_proj(hidden)], dim=-1)
    query, key, value = F.silu(causal_conv(mixed, layer.conv1d)).view(batch, length, 3, heads, head_dim).unbind(2)
    gate_layer = layer.forget_gate
    if family == "kimi_linear":  # low-rank gate, softplus
        gate_input = gate_layer.f_b_proj(gate_layer.f_a_proj(hidden)) + gate_layer.dt_bias
        log_decay = -gate_layer.A_log.exp().view(heads, 1) * F.softplus(gate_input.view(batch, length, heads, head_dim))
        output_gate = layer.g_b_proj(layer.g_a_proj(hidden))
    else:  # bailing_hybrid: full-rank gate, bounded ("safe") form lower_bound * sigmoid(.)
        gate_input = (gate_layer.f_proj(hidden) + gate_layer.dt_bias).view(batch, length, heads, head_dim)
        log_decay = gate_layer.lower_bound * torch.sigmoid(gate_layer.A_log.exp().view(heads, 1) * gate_input)
        output_gate = layer.g_proj(hidden)
    beta = torch.sigmoid(layer.b_proj(hidden))
    core, _ = kda(head_major(l2norm(query) * head_dim**-0.5), head_major(l2norm(key)), head_major(value),
                  head_major(log_decay), head_major(beta))
    normed = rms_norm(head_major(core), layer.o_norm.weight, layer.o_norm.variance_epsilon)
    gated = normed * torch.sigmoid(output_gate.view(batch, length, heads, head_dim))
    return layer.o_proj(gated.reshape(batch, length, heads * head_dim))


@pytest.mark.parametrize("family", ["kimi_linear", "bailing_hybrid"])
def test_kda_mixer_matches_transformers(family: str) -> None:
    if family == "kimi_linear":
        from transformers import KimiLinearConfig
        from transformers.models.kimi_linear.modeling_kimi_linear import (
            KimiLinearDeltaAttention as Layer,
        )

        config = KimiLinearConfig(hidden_size=32, linear_num_heads=2, linear_head_dim=8, num_hidden_layers=2,
                                  pad_token_id=0)
    else:
        from transformers import BailingHybridConfig
        from transformers.models.bailing_hybrid.modeling_bailing_hybrid import (
            BailingHybridDeltaAttention as Layer,
        )

        config = BailingHybridConfig(hidden_size=32, num_attention_heads=2, head_dim=8, num_hidden_layers=2,
                                     pad_token_id=0, eos_token_id=1)
    layer = randomise(Layer(config, 0), seed=1)
    hidden = torch.randn(2, 45, 32)
    with torch.no_grad():
        torch.testing.assert_close(kda_mixer(layer, hidden, family), layer(hidden), **TOLERANCE)


def olmo_mixer(layer, hidden: torch.Tensor) -> torch.Tensor:
    """olmo_hybrid linear layer: Gated DeltaNet with separate q/k/v/a/b/g projections and beta in [0, 2]."""
    batch, length, _ = hidden.shape
    mixed = torch.cat([layer.q_proj(hidden), layer.k_proj(hidden), layer.v_proj(hidden)], dim=-1)
    convolved = F.silu(causal_conv(mixed, layer.conv1d))
    query, key, value = convolved.split([layer.key_dim, layer.key_dim, layer.value_dim], -1)
    repeat = layer.num_v_heads // layer.num_k_heads
    query, key = (x.view(batch, length, layer.num_k_heads, layer.head_k_dim).repeat_interleave(repeat, dim=2)
                  for x in (query, key))
    value = value.view(batch, length, layer.num_v_heads, layer.head_v_dim)
    beta = torch.sigmoid(layer.b_proj(hidden)) * (2.0 if layer.allow_neg_eigval else 1.0)
    log_decay = -layer.A_log.exp() * F.softplus(layer.a_proj(hidden) + layer.dt_bias)
    core, _ = gated_delta_rule(head_major(l2norm(query) * layer.head_k_dim**-0.5), head_major(l2norm(key)),
                               head_major(value), head_major(log_decay), head_major(beta))
    normed = rms_norm(head_major(core), layer.o_norm.weight, layer.o_norm.variance_epsilon)
    gated = normed * F.silu(layer.g_proj(hidden).view(batch, length, layer.num_v_heads, layer.head_v_dim))
    return layer.o_proj(gated.reshape(batch, length, -1))


def test_olmo_hybrid_mixer_is_gated_deltanet() -> None:
    from transformers import OlmoHybridConfig
    from transformers.models.olmo_hybrid.modeling_olmo_hybrid import (
        OlmoHybridGatedDeltaNet,
    )

    config = OlmoHybridConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, linear_num_key_heads=2,
                              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
                              pad_token_id=0, eos_token_id=1)
    layer = randomise(OlmoHybridGatedDeltaNet(config, 0), seed=2)
    hidden = torch.randn(2, 45, 32)
    with torch.no_grad():
        torch.testing.assert_close(olmo_mixer(layer, hidden), layer(hidden), **TOLERANCE)


@pytest.mark.parametrize("length", [1, 63, 131])
def test_gated_delta_rule_with_beta_up_to_two(length: int) -> None:
    """allow_neg_eigval: b in [0, 2] (eigenvalues of I - b k k^T in [-1, 1]); chunked form still equals the
    reference, and both equal transformers' olmo_hybrid torch functions."""
    from transformers.models.olmo_hybrid import modeling_olmo_hybrid as modeling

    generator = torch.Generator().manual_seed(length)
    batch, heads, key_dim, value_dim = 2, 3, 16, 8
    raw_query, raw_key = (torch.randn(batch, length, heads, key_dim, generator=generator) for _ in range(2))
    value = torch.randn(batch, length, heads, value_dim, generator=generator)
    log_decay = -torch.rand(batch, length, heads, generator=generator)
    beta = 2 * torch.rand(batch, length, heads, generator=generator)
    start = torch.randn(batch, heads, key_dim, value_dim, generator=generator)
    run = modeling.torch_recurrent_gated_delta_rule if length == 1 else modeling.torch_chunk_gated_delta_rule
    expected_output, expected_state = run(
        raw_query, raw_key, value, g=log_decay, beta=beta, initial_state=start.clone(), output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    inputs = (head_major(modeling.l2norm(raw_query)) * key_dim**-0.5, head_major(modeling.l2norm(raw_key)),
              head_major(value), head_major(log_decay), head_major(beta))
    reference_output, reference_state = naive_recurrent_gated_delta_rule(*inputs, start)
    output, state = chunk_gated_delta_rule(*inputs, start, chunk_size=32)
    torch.testing.assert_close(output, reference_output, **TOLERANCE)
    torch.testing.assert_close(state, reference_state, **TOLERANCE)
    torch.testing.assert_close(head_major(output), expected_output, **TOLERANCE)
    torch.testing.assert_close(state, expected_state, **TOLERANCE)


def lfm2_mixer(layer, hidden: torch.Tensor, tail: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """lfm2 conv layer: in_proj -> (B, C, x) in that order, conv over B*x (no activation), C gate, out_proj.
    Returns the output and the conv tail (last kernel-1 values of B*x, [batch, kernel-1, hidden])."""
    gate_b, gate_c, x = layer.in_proj(hidden).chunk(3, dim=-1)
    conv_input = gate_b * x
    convolved = causal_conv(conv_input, layer.conv, tail)
    width = layer.conv.weight.shape[-1] - 1
    context = conv_input if tail is None else torch.cat([tail, conv_input], dim=1)
    return layer.out_proj(gate_c * convolved), context[:, -width:]


def test_lfm2_short_conv_matches_transformers_and_carries_only_a_tail() -> None:
    from transformers import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

    config = Lfm2Config(hidden_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        full_attn_idxs=[1], conv_bias=True)
    layer = randomise(Lfm2ShortConv(config, 0), seed=3)
    hidden = torch.randn(2, 20, 24)
    with torch.no_grad():
        expected = layer(hidden)
        whole, _ = lfm2_mixer(layer, hidden)
        first, tail = lfm2_mixer(layer, hidden[:, :7])
        second, _ = lfm2_mixer(layer, hidden[:, 7:], tail)
    assert tail.shape == (2, config.conv_L_cache - 1, 24)
    torch.testing.assert_close(whole, expected, **TOLERANCE)
    torch.testing.assert_close(torch.cat([first, second], dim=1), expected, **TOLERANCE)
