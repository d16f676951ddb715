"""Mamba1 selective scan: blocked and step paths against the naive float32 recurrence, elementwise transitions,
and against transformers' own jamba torch path (JambaMambaMixer forward, mamba_selective_state_update)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.jamba import modeling_jamba

from hypic_rag.runtime.ops.selective_scan import (
    apply_selective_scan_transition,
    blocked_selective_scan,
    compose_selective_scan_transitions,
    naive_selective_scan,
    recurrent_selective_scan,
    select_backend,
    selective_scan,
    selective_scan_start_output,
    selective_scan_varlen,
    selective_scan_with_transition,
)
from hypic_rag.runtime.ops.time_step import softplus_time_step


def random_inputs(batch: int, channels: int, length: int, state_size: int, seed: int, strong_decay: bool = False):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, length, generator=generator)
    raw = torch.randn(batch, length, channels, generator=generator) * (3.0 if strong_decay else 1.0)
    dt = softplus_time_step(raw, torch.linspace(-2.0, 0.5, channels)).transpose(1, 2)  # [batch, D, T]
    a = -torch.exp(torch.rand(channels, state_size, generator=generator) * (5.0 if strong_decay else 2.0) - 1.0)
    b = torch.randn(batch, length, state_size, generator=generator)
    c = torch.randn(batch, length, state_size, generator=generator)
    d = torch.randn(channels, generator=generator)
    start = torch.randn(batch, channels, state_size, generator=generator)
    return x, dt, a, b, c, d, start


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [1, 7, 31, 32, 33, 100])
@pytest.mark.parametrize("block_size", [8, 32])
def test_blocked_scan_matches_naive_on_odd_lengths(length: int, block_size: int) -> None:
    x, dt, a, b, c, d, start = random_inputs(2, 12, length, 5, seed=length)
    expected_output, expected_state = naive_selective_scan(x, dt, a, b, c, d, start)
    output, state = blocked_selective_scan(x, dt, a, b, c, d, start, block_size=block_size)
    assert output.shape == (2, 12, length) and state.shape == (2, 12, 5)
    close(output, expected_output)
    close(state, expected_state)


def test_blocked_scan_is_stable_with_strong_decay() -> None:
    x, dt, a, b, c, d, start = random_inputs(1, 8, 80, 6, seed=3, strong_decay=True)
    assert (dt[..., None] * a[None, :, None, :]).min() < -100  # decays far below float32's smallest number
    expected_output, expected_state = naive_selective_scan(x, dt, a, b, c, d, start)
    output, state = blocked_selective_scan(x, dt, a, b, c, d, start, block_size=16)
    assert torch.isfinite(output).all() and torch.isfinite(state).all()
    close(output, expected_output)
    close(state, expected_state)


@pytest.mark.parametrize("length", [0, 1, 3, 9])
def test_recurrent_matches_naive_and_keeps_its_input_state(length: int) -> None:
    x, dt, a, b, c, d, start = random_inputs(2, 6, length, 4, seed=20 + length)
    start_copy = start.clone()
    expected_output, expected_state = naive_selective_scan(x, dt, a, b, c, d, start)
    output, state = recurrent_selective_scan(x, dt, a, b, c, d, start)
    close(output, expected_output)
    close(state, expected_state)
    assert torch.equal(start, start_copy)
    close(recurrent_selective_scan(x, dt, a, b, c, None)[1], naive_selective_scan(x, dt, a, b, c)[1])


@pytest.mark.parametrize("cuts", [[1], [17], [40, 41], [5, 23, 50]])
def test_split_sequence_carries_state(cuts: list[int]) -> None:
    x, dt, a, b, c, d, start = random_inputs(2, 6, 57, 4, seed=11)
    whole_output, whole_state = blocked_selective_scan(x, dt, a, b, c, d, start, block_size=16)
    state, pieces = start, []
    for begin, end in zip([0, *cuts], [*cuts, 57]):
        piece, state = blocked_selective_scan(x[:, :, begin:end], dt[:, :, begin:end], a, b[:, begin:end],
                                              c[:, begin:end], d, state, block_size=16)
        pieces.append(piece)
    close(torch.cat(pieces, dim=2), whole_output)
    close(state, whole_state)


@pytest.mark.parametrize("length", [1, 29, 70])
def test_transition_is_elementwise_and_reproduces_any_start(length: int) -> None:
    x, dt, a, b, c, d, start = random_inputs(2, 6, length, 4, seed=5)
    zero_output, cumulative_dt, transition, state = selective_scan_with_transition(x, dt, a, b, c, d, block_size=16)
    assert transition.shape == state.shape == start.shape == (2, 6, 4)
    close(transition, torch.exp(dt.sum(-1)[..., None] * a))
    expected_output, expected_state = naive_selective_scan(x, dt, a, b, c, d, start)
    zero_start_output, zero_start_state = naive_selective_scan(x, dt, a, b, c, d)
    close(state, zero_start_state)
    close(zero_output, zero_start_output)
    # S_end(S_0) == P * S_0 + S_end(0), and the outputs from S_0 without rerunning the span
    close(apply_selective_scan_transition(transition, state, start), expected_state)
    close(zero_output + selective_scan_start_output(cumulative_dt, a, c, start), expected_output)


def test_transitions_compose_over_random_chunks() -> None:
    x, dt, a, b, c, d, start = random_inputs(1, 6, 90, 4, seed=9)
    cuts = sorted(torch.randperm(88, generator=torch.Generator().manual_seed(2))[:5].add(1).tolist())
    composed = None
    for begin, end in zip([0, *cuts], [*cuts, 90]):
        _, _, transition, state = selective_scan_with_transition(x[:, :, begin:end], dt[:, :, begin:end], a,
                                                                 b[:, begin:end], c[:, begin:end], d)
        pair = (transition, state)
        composed = pair if composed is None else compose_selective_scan_transitions(composed, pair)
    close(apply_selective_scan_transition(*composed, start), naive_selective_scan(x, dt, a, b, c, d, start)[1])


def test_empty_span_is_identity() -> None:
    x, dt, a, b, c, d, start = random_inputs(1, 3, 0, 4, seed=0)
    output, _, transition, state = selective_scan_with_transition(x, dt, a, b, c, d)
    assert output.shape == (1, 3, 0)
    torch.testing.assert_close(apply_selective_scan_transition(transition, state, start), start)
    torch.testing.assert_close(blocked_selective_scan(x, dt, a, b, c, d, start)[1], start)


def test_dispatch_uses_the_step_path_on_cpu_and_matches_naive() -> None:
    x, dt, a, b, c, d, start = random_inputs(1, 4, 40, 3, seed=41)
    assert select_backend(x) == "recurrent" and select_backend(x[:, :, :2]) == "recurrent"
    expected_output, expected_state = naive_selective_scan(x, dt, a, b, c, d, start)
    output, state = selective_scan(x, dt, a, b, c, d, start)
    close(output, expected_output)
    close(state, expected_state)


def test_varlen_and_right_padded_batches_give_each_sequence_its_own_state() -> None:
    bounds = [0, 9, 9, 39, 43]
    x, dt, a, b, c, d, _ = random_inputs(1, 5, 43, 3, seed=7)
    starts = torch.randn(4, 5, 3, generator=torch.Generator().manual_seed(8))
    output, finals = selective_scan_varlen(x, dt, a, b, c, bounds, d, starts)
    padded_x, padded_dt = torch.zeros(4, 5, 30), torch.zeros(4, 5, 30)
    padded_b, padded_c = torch.zeros(4, 30, 3), torch.zeros(4, 30, 3)
    for number, (begin, end) in enumerate(zip(bounds, bounds[1:])):
        expected_output, expected_state = naive_selective_scan(x[:, :, begin:end], dt[:, :, begin:end], a,
                                                               b[:, begin:end], c[:, begin:end], d,
                                                               starts[number : number + 1])
        close(output[:, :, begin:end], expected_output)
        close(finals[number : number + 1], expected_state)
        padded_x[number, :, : end - begin], padded_dt[number, :, : end - begin] = x[0, :, begin:end], dt[0, :, begin:end]
        padded_b[number, : end - begin], padded_c[number, : end - begin] = b[0, begin:end], c[0, begin:end]
    # right-padding with dt = 0 (and x = 0) leaves each row's state as its sequence left it
    batch_output, batch_finals = blocked_selective_scan(padded_x, padded_dt, a, padded_b, padded_c, d, starts, 8)
    close(batch_finals, finals)
    close(batch_output[2], output[0, :, 9:39])
    with pytest.raises(ValueError, match="cu_seqlens"):
        selective_scan_varlen(x, dt, a, b, c, [0, 50, 43], d)


def tiny_jamba_mixer(seed: int) -> torch.nn.Module:
    """The first Mamba mixer of a random 2-layer JambaConfig, with unit-scale projections and random norms/D/A."""
    torch.manual_seed(seed)
    config = transformers.JambaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
        num_experts=4, mamba_d_state=8, mamba_dt_rank=4,
    )
    mixer = transformers.AutoModelForCausalLM.from_config(config).eval().model.layers[0].mamba
    with torch.no_grad():
        for linear in (mixer.in_proj, mixer.x_proj, mixer.dt_proj, mixer.out_proj):
            linear.weight.normal_(0.0, linear.weight.shape[1] ** -0.5)
        mixer.dt_proj.bias.copy_(torch.randn_like(mixer.dt_proj.bias) - 1.0)
        mixer.conv1d.weight.normal_(0.0, 0.5)
        mixer.A_log.copy_(torch.empty_like(mixer.A_log).uniform_(-1.0, 2.5))
        mixer.D.copy_(torch.randn_like(mixer.D))
        for norm in (mixer.dt_layernorm, mixer.b_layernorm, mixer.c_layernorm):
            norm.weight.copy_(1.0 + 0.3 * torch.randn_like(norm.weight))
    return mixer


def rms_norm(values: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    return values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight


def jamba_scan_inputs(mixer: torch.nn.Module, hidden: torch.Tensor):
    """Jamba's mixer up to the scan (docs/families_ssm.md): returns x, dt [batch, D, T], a, b, c, gate [batch, D, T]."""
    length = hidden.shape[1]
    x, gate = mixer.in_proj(hidden).transpose(1, 2).chunk(2, dim=1)  # [batch, D, T] each: x first, then the gate
    kernel = mixer.conv1d.weight.shape[-1]
    x = torch.nn.functional.silu(torch.nn.functional.conv1d(
        x, mixer.conv1d.weight, mixer.conv1d.bias, padding=kernel - 1, groups=x.shape[1])[..., :length])
    rank, state_size = mixer.time_step_rank, mixer.ssm_state_size
    raw_dt, b, c = mixer.x_proj(x.transpose(1, 2)).split([rank, state_size, state_size], dim=-1)
    raw_dt = rms_norm(raw_dt, mixer.dt_layernorm) @ mixer.dt_proj.weight.T  # [batch, T, D]; the bias goes in softplus
    dt = softplus_time_step(raw_dt, mixer.dt_proj.bias).transpose(1, 2)
    return x, dt, -mixer.A_log.float().exp(), rms_norm(b, mixer.b_layernorm), rms_norm(c, mixer.c_layernorm), gate


@pytest.mark.parametrize("use_blocked", [False, True])
def test_jamba_mixer_rebuilt_on_the_scan_matches_transformers(use_blocked: bool) -> None:
    mixer = tiny_jamba_mixer(seed=3)
    hidden = torch.randn(2, 45, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = mixer(hidden)  # cache=None: transformers' sequential torch scan
        x, dt, a, b, c, gate = jamba_scan_inputs(mixer, hidden)
        scan = blocked_selective_scan if use_blocked else selective_scan
        y, _ = scan(x, dt, a, b, c, mixer.D)
        actual = mixer.out_proj((y * torch.nn.functional.silu(gate)).transpose(1, 2))
    assert expected.abs().mean() > 0.1
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_jamba_final_state_and_decode_step_match_transformers() -> None:
    mixer = tiny_jamba_mixer(seed=4)
    hidden = torch.randn(1, 23, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        x, dt, a, b, c, _ = jamba_scan_inputs(mixer, hidden)
        # transformers' scan takes dt before its bias and softplus; it always starts from zeros
        raw_dt = (rms_norm(mixer.x_proj(x.transpose(1, 2))[..., : mixer.time_step_rank], mixer.dt_layernorm)
                  @ mixer.dt_proj.weight.T).transpose(1, 2)
        expected, expected_state = modeling_jamba.mamba_selective_scan(
            x[:, :, :20], raw_dt[:, :, :20], a, b[:, :20].transpose(1, 2), c[:, :20].transpose(1, 2),
            D=mixer.D.float(), delta_bias=mixer.dt_proj.bias.float(), delta_softplus=True, return_last_state=True,
        )
        output, state = selective_scan(x[:, :, :20], dt[:, :, :20], a, b[:, :20], c[:, :20], mixer.D)
        close(output, expected)
        close(state, expected_state)
        # three decode steps from that state: transformers updates its state in place
        stepped, final = recurrent_selective_scan(x[:, :, 20:], dt[:, :, 20:], a, b[:, 20:], c[:, 20:], mixer.D, state)
        for t in range(3):
            expected_step = modeling_jamba.mamba_selective_state_update(
                expected_state, x[:, :, 20 + t], raw_dt[:, :, 20 + t], a, b[:, 20 + t], c[:, 20 + t], mixer.D,
                dt_bias=mixer.dt_proj.bias.float(), dt_softplus=True,
            )
            close(stepped[:, :, t], expected_step)
        close(final, expected_state)


def test_a_large_batch_runs_in_groups_of_rows_with_the_same_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step recurrence and the start-state outputs take a batch whose states would leave cache in groups of
    rows (`STATE_BLOCK_ELEMENTS`, `START_OUTPUT_ELEMENTS`): every row gets the values it gets in one call."""
    from hypic_rag.runtime.ops.selective_scan import recurrent, transition

    x, dt, a, b, c, d, start = random_inputs(7, 12, 9, 5, seed=11)
    whole_output, whole_state = recurrent_selective_scan(x, dt, a, b, c, d, start)
    _, cumulative_dt, _, _ = selective_scan_with_transition(x, dt, a, b, c, d)
    whole_added = selective_scan_start_output(cumulative_dt, a, c, start)
    monkeypatch.setattr(recurrent, "STATE_BLOCK_ELEMENTS", 2 * 12 * 5)  # groups of two rows (and one of one)
    monkeypatch.setattr(transition, "START_OUTPUT_ELEMENTS", 3 * 12 * 9 * 5)  # groups of three rows
    output, state = recurrent_selective_scan(x, dt, a, b, c, d, start)
    torch.testing.assert_close(output, whole_output, atol=0, rtol=0)
    torch.testing.assert_close(state, whole_state, atol=0, rtol=0)
    torch.testing.assert_close(selective_scan_start_output(cumulative_dt, a, c, start), whole_added, atol=0, rtol=0)
    expected_output, expected_state = naive_selective_scan(x, dt, a, b, c, d, start)
    close(output, expected_output)
    close(state, expected_state)
