"""The SSD op against transformers' own torch paths (no mamba_ssm / causal_conv1d here) on tiny random mixers.

For each Mamba2 family the mixer is rebuilt around `chunk_ssd` exactly as docs/families_ssm.md describes
(multipliers, projection split, conv, dt, grouped gated RMSNorm, out_proj) and compared with the module's forward;
the scan with a start state and the decode step are compared with transformers' `mamba2_chunk_scan` and
`mamba2_selective_state_update` (whose state layout is [batch, H, P, N], ours [batch, H, N, P]).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.bamba import modeling_bamba

from hypic_rag.runtime.ops.ssd import chunk_ssd, recurrent_ssd
from hypic_rag.runtime.ops.time_step import softplus_time_step

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


def tiny_config(family: str, **overrides) -> transformers.PretrainedConfig:
    """A 2-4 layer random config of `family` with 8 SSD heads in 2 groups, state 8, prefill chunk 16."""
    if family == "bamba":
        return transformers.BambaConfig(**SIZES, num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=8,
                                        mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=16, **overrides)
    if family == "granitemoehybrid":
        return transformers.GraniteMoeHybridConfig(
            **SIZES, shared_intermediate_size=48, num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=16, num_local_experts=4,
            num_experts_per_tok=2, **overrides)
    if family == "nemotron_h":
        return transformers.NemotronHConfig(
            **SIZES, layers_block_type=["linear_attention", "mlp", "full_attention", "moe"], head_dim=8,
            mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=8, chunk_size=16, n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16, **overrides)
    if family == "falcon_h1":
        return transformers.FalconH1Config(
            **SIZES, num_hidden_layers=1, mamba_d_ssm=64, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=8,
            mamba_chunk_size=16, ssm_multipliers=[0.5, 1.5, 0.7, 1.2, 0.9], ssm_in_multiplier=1.3, **overrides)
    if family == "zamba2":
        return transformers.Zamba2Config(**SIZES, num_hidden_layers=2, layers_block_type=["mamba", "hybrid"],
                                         n_mamba_heads=8, mamba_ngroups=2, mamba_d_state=8, chunk_size=16, **overrides)
    raise ValueError(family)


def first_mixer(config: transformers.PretrainedConfig, seed: int) -> torch.nn.Module:
    """The first Mamba2 mixer of a random model of `config`, its parameters re-drawn so none is a trivial 1 or 0."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    mixer = next(m for m in model.modules() if hasattr(m, "A_log") and hasattr(m, "dt_bias"))
    with torch.no_grad():
        for linear in (mixer.in_proj, mixer.out_proj):  # unit-scale outputs (the 0.02 init makes them ~1e-3)
            linear.weight.normal_(0.0, linear.weight.shape[1] ** -0.5)
        mixer.conv1d.weight.normal_(0.0, 0.5)
        mixer.A_log.copy_(torch.empty_like(mixer.A_log).uniform_(-1.0, 1.5))
        mixer.dt_bias.copy_(torch.randn_like(mixer.dt_bias) - 1.0)
        mixer.D.copy_(torch.randn_like(mixer.D))
        if isinstance(mixer.norm, torch.nn.Module) and hasattr(mixer.norm, "weight"):
            mixer.norm.weight.copy_(1.0 + 0.3 * torch.randn_like(mixer.norm.weight))
        if mixer.conv1d.bias is not None:
            mixer.conv1d.bias.copy_(0.1 * torch.randn_like(mixer.conv1d.bias))
    return mixer


def gated_rms_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, groups: int, eps: float,
                   norm_before_gate: bool) -> torch.Tensor:
    """RMSNorm over each of `groups` equal slices of the last dim, times weight, with y * silu(gate) before or after."""
    if not norm_before_gate:
        y = y * torch.nn.functional.silu(gate)
    sliced = y.reshape(*y.shape[:-1], groups, -1)
    y = (sliced * torch.rsqrt(sliced.pow(2).mean(-1, keepdim=True) + eps)).reshape(y.shape) * weight
    return y * torch.nn.functional.silu(gate) if norm_before_gate else y


def mixer_with_ops(mixer: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The mixer's forward [batch, T, hidden] -> [batch, T, hidden] rebuilt around `chunk_ssd` (float32, no cache)."""
    batch, length, _ = hidden.shape
    inner, heads, groups = mixer.intermediate_size, mixer.num_heads, mixer.n_groups
    state_size, head_dim = mixer.ssm_state_size, mixer.head_dim
    projected = mixer.in_proj(hidden * getattr(mixer, "ssm_in_multiplier", 1.0))
    if hasattr(mixer, "mup_vector"):  # falcon_h1: per-slice multipliers [z | x | B | C | dt]
        projected = projected * mixer.mup_vector
    gate, conv_input, raw_dt = projected.split([inner, inner + 2 * groups * state_size, heads], dim=-1)
    kernel = mixer.conv1d.weight.shape[-1]
    convolved = torch.nn.functional.conv1d(
        conv_input.transpose(1, 2), mixer.conv1d.weight, mixer.conv1d.bias, padding=kernel - 1,
        groups=conv_input.shape[-1],
    )[..., :length].transpose(1, 2)
    x, b, c = torch.nn.functional.silu(convolved).split([inner, groups * state_size, groups * state_size], dim=-1)
    dt = softplus_time_step(raw_dt, mixer.dt_bias, mixer.time_step_limit)  # [batch, T, H]
    y, _ = chunk_ssd(
        x.reshape(batch, length, heads, head_dim).transpose(1, 2), dt.transpose(1, 2), -mixer.A_log.float().exp(),
        b.reshape(batch, length, groups, state_size).transpose(1, 2),
        c.reshape(batch, length, groups, state_size).transpose(1, 2), mixer.D, chunk_size=16,
    )
    y = y.transpose(1, 2).reshape(batch, length, inner)
    norm = mixer.norm
    if isinstance(norm, torch.nn.Identity):  # falcon_h1 with mamba_rms_norm=False: gate only
        y = y * torch.nn.functional.silu(gate)
    elif hasattr(norm, "norm_before_gate"):  # falcon_h1: n_groups slices, gate before or after
        y = gated_rms_norm(y, gate, norm.weight, norm.n_groups, norm.variance_epsilon, norm.norm_before_gate)
    else:  # bamba, granitemoehybrid, nemotron_h, zamba2: gate first, then RMSNorm per group of inner / G channels
        y = gated_rms_norm(y, gate, norm.weight, inner // norm.group_size, norm.variance_epsilon, False)
    return mixer.out_proj(y)


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("bamba", {}),
        ("bamba", {"time_step_limit": (0.05, 0.6)}),
        ("granitemoehybrid", {}),
        ("nemotron_h", {}),
        ("zamba2", {}),
        ("falcon_h1", {"mamba_rms_norm": False}),
        ("falcon_h1", {"mamba_rms_norm": True, "mamba_norm_before_gate": True}),
        ("falcon_h1", {"mamba_rms_norm": True, "mamba_norm_before_gate": False}),
    ],
)
def test_mixer_rebuilt_on_chunk_ssd_matches_transformers(family: str, overrides: dict) -> None:
    mixer = first_mixer(tiny_config(family, **overrides), seed=len(family))
    hidden = torch.randn(2, 37, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = mixer(hidden)  # cache=None, eval: transformers' torch chunked path
        actual = mixer_with_ops(mixer, hidden)
    assert expected.abs().mean() > 0.1
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def scan_inputs(seed: int, length: int):
    generator = torch.Generator().manual_seed(seed)
    batch, heads, groups, head_dim, state_size = 2, 6, 3, 4, 5
    x = torch.randn(batch, length, heads, head_dim, generator=generator)
    raw_dt = torch.randn(batch, length, heads, generator=generator)
    bias = torch.randn(heads, generator=generator)
    a = -torch.rand(heads, generator=generator) * 3 - 0.1
    b = torch.randn(batch, length, groups, state_size, generator=generator)
    c = torch.randn(batch, length, groups, state_size, generator=generator)
    d = torch.randn(heads, generator=generator)
    start = torch.randn(batch, heads, head_dim, state_size, generator=generator)  # transformers' layout [.., P, N]
    return x, raw_dt, bias, a, b, c, d, start


@pytest.mark.parametrize("length", [5, 33])
def test_chunk_scan_with_start_state_matches_transformers(length: int) -> None:
    x, raw_dt, bias, a, b, c, d, start = scan_inputs(3, length)
    limit = (0.01, 2.0)
    expected, expected_state = modeling_bamba.mamba2_chunk_scan(
        x, raw_dt, a, b, c, chunk_size=8, D=d, dt_bias=bias, initial_states=start, dt_softplus=True, dt_limit=limit,
        return_final_states=True,
    )
    dt = softplus_time_step(raw_dt, bias, limit).transpose(1, 2)
    output, state = chunk_ssd(x.transpose(1, 2), dt, a, b.transpose(1, 2), c.transpose(1, 2), d,
                              start.transpose(-1, -2), chunk_size=16)
    torch.testing.assert_close(output.transpose(1, 2), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.transpose(-1, -2), expected_state, atol=1e-5, rtol=1e-5)


def test_decode_step_matches_transformers_selective_state_update() -> None:
    x, raw_dt, bias, a, b, c, d, start = scan_inputs(4, 3)
    state = start.clone()
    heads, head_dim, state_size = x.shape[2], x.shape[3], b.shape[-1]
    output, final = recurrent_ssd(
        x.transpose(1, 2), softplus_time_step(raw_dt, bias).transpose(1, 2), a, b.transpose(1, 2), c.transpose(1, 2),
        d, start.transpose(-1, -2),
    )
    for t in range(3):  # the mixer's per-token call: everything expanded over P, state updated in place
        expected = modeling_bamba.mamba2_selective_state_update(
            state, x[:, t], raw_dt[:, t, :, None].expand(-1, -1, head_dim),
            a[:, None, None].expand(-1, head_dim, state_size), b[:, t], c[:, t], d[:, None].expand(-1, head_dim),
            dt_bias=bias[:, None].expand(-1, head_dim), dt_softplus=True,
        )
        torch.testing.assert_close(output[:, :, t], expected, atol=1e-5, rtol=1e-5)
    assert heads == output.shape[1]
    torch.testing.assert_close(final.transpose(-1, -2), state, atol=1e-5, rtol=1e-5)
