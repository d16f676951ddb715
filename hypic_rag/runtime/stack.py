"""One pass of the layer stack over a plan of spans: only the recomputed tokens get hidden states.

A request is laid out as contiguous spans. A span's first `recompute` tokens go through the stack with the true
context; the rest come from the span's cached entry:
- linear layer: the running state h walks the spans in order; recomputed tokens run the delta rule from h (their
  conv sees the running conv tail), then the cached remainder applies its affine map h <- P h + Z (or h + Z in
  `addition`), and the conv tail takes the cached tail;
- attention layer: queries of recomputed tokens attend causally to every position; keys/values are fresh for
  recomputed tokens and the cached pre-RoPE keys, rotated at their true positions (or left at their standalone
  positions when `reposition_keys` is off), for the rest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from hypic_rag.entry import LINEAR_LAYER, SEAM_TOKENS, Entry, tensor_name
from hypic_rag.kernels import triton_enabled
from hypic_rag.runtime import layers as L
from hypic_rag.runtime.model import HybridModel
from hypic_rag.runtime.ops.gated_delta_rule import gated_delta_rule, gated_delta_rule_with_transition
from hypic_rag.runtime.segment_state import SegmentState
from hypic_rag.runtime.state import AttentionLayerState, DecodeState, LinearLayerState


@dataclass(slots=True)
class Span:
    """token_ids [L] at sequence positions start..start+L-1; the first `recompute` tokens are recomputed.

    entry: the span's cached entry, whose suffix pair must start at `recompute` (its `seam_tokens`); None when the
    whole span is recomputed.
    """

    token_ids: list[int]
    start: int
    recompute: int
    entry: Entry | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.recompute <= len(self.token_ids):
            raise ValueError(f"recompute={self.recompute} outside 0..{len(self.token_ids)}")
        if self.entry is None and self.recompute != len(self.token_ids):
            raise ValueError("a span without a cached entry must be recomputed whole")

    @property
    def length(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class StackOptions:
    """reposition_keys: rotate cached keys at their true positions (False: keep standalone positions).
    composition: "transition" applies P h + Z per cached span; "addition" applies h + Z (the naive baseline)."""

    reposition_keys: bool = True
    composition: Literal["transition", "addition"] = "transition"

    def __post_init__(self) -> None:
        if self.composition not in ("transition", "addition"):
            raise ValueError(f"unknown composition {self.composition!r}")


@dataclass(slots=True)
class StackResult:
    """logits: [vocab] of the last recomputed token; all_logits: [R, vocab] when asked;
    checkpoints: decode states at each span end when asked; compose_seconds: time spent composing cached state."""

    logits: torch.Tensor
    state: DecodeState
    recomputed_tokens: int
    all_logits: torch.Tensor | None = None
    checkpoints: list[DecodeState] = field(default_factory=list)
    compose_seconds: float = 0.0


def _apply_cached_linear(
    state: torch.Tensor, cached: list[tuple[Entry, int]], layer_index: int, composition: str
) -> torch.Tensor:
    """Advance the recurrent state [H, K, V] over consecutive spans' cached remainders, in order; `cached` holds
    each span's (entry, recomputed tokens). On CUDA (`hypic_rag.kernels.triton_enabled`) one Triton launch composes
    them all, reading P/Z in their storage dtype and accumulating in float32."""
    for entry, recompute in cached:
        if int(entry[SEAM_TOKENS]) != recompute:
            raise ValueError(f"entry was encoded with seam {int(entry[SEAM_TOKENS])}, span recomputes {recompute}")
    states = [entry[tensor_name(layer_index, "suffix_state")] for entry, _ in cached]
    transitions = None if composition == "addition" else [entry[tensor_name(layer_index, "transition")] for entry, _ in cached]
    if triton_enabled(state):
        from hypic_rag.kernels.compose import compose_affine

        return compose_affine(state, None if transitions is None else torch.stack(transitions), torch.stack(states))
    for number, suffix_state in enumerate(states):
        if transitions is None:
            state = state + suffix_state.float()
        else:
            state = SegmentState(transitions[number], suffix_state).apply(state)
    return state


def _apply_pending(
    state: torch.Tensor, pending: list[tuple[dict[str, torch.Tensor], int]], layer_index: int, composition: str
) -> tuple[torch.Tensor, float]:
    """`_apply_cached_linear` over `pending` (then emptied); returns the new state and the seconds it took."""
    began = time.perf_counter()
    state = _apply_cached_linear(state, pending, layer_index, composition)
    pending.clear()
    return state, time.perf_counter() - began


def _rotate_into(
    buffer: torch.Tensor, at: int, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position: int
) -> None:
    """buffer[:, at : at + L] = pre-RoPE keys [H, L, D] rotated at positions position .. position + L - 1 (cos, sin
    [P, R] by position): the Triton kernel on CUDA (`hypic_rag.kernels.rope`), `layers.apply_rotary` elsewhere."""
    length = keys.shape[1]
    if triton_enabled(buffer):
        from hypic_rag.kernels.rope import rope_into

        rope_into(buffer, at, keys.to(buffer.device), cos, sin, position)
        return
    keys = keys.to(device=buffer.device, dtype=buffer.dtype)
    buffer[:, at : at + length] = L.apply_rotary(keys, cos[position : position + length], sin[position : position + length])


def _merge_recomputed_spans(spans: list[Span]) -> list[Span]:
    """Neighbouring spans recomputed whole run as one span (one delta-rule call instead of one per span); exact,
    since nothing cached sits between them. Only when no per-span checkpoints are wanted."""
    merged: list[Span] = []
    for span in spans:
        if merged and span.entry is None and merged[-1].entry is None:
            last = merged[-1]
            merged[-1] = Span(last.token_ids + span.token_ids, last.start, last.recompute + span.recompute)
        else:
            merged.append(span)
    return merged


def _advance_tail_cached(tail: torch.Tensor, cached_tail: torch.Tensor, suffix_length: int) -> torch.Tensor:
    """Conv tail after a cached suffix of `suffix_length` tokens whose own last inputs are `cached_tail`."""
    width = tail.shape[-1]
    if width == 0 or suffix_length == 0:
        return tail
    if suffix_length >= width:
        return cached_tail.float().clone()
    return torch.cat([tail, cached_tail.float()[:, -suffix_length:]], dim=1)[:, -width:].contiguous()


@torch.no_grad()
def run_stack(
    model: HybridModel,
    spans: list[Span],
    initial: DecodeState | None = None,
    options: StackOptions | None = None,
    *,
    want_checkpoints: bool = False,
    want_all_logits: bool = False,
) -> StackResult:
    """Run the stack over `spans` (contiguous, starting at `initial.length` or 0) and return the next-token logits."""
    options = options or StackOptions()
    device, dtype = model.device, model.dtype
    if not want_checkpoints:
        spans = _merge_recomputed_spans(spans)
    start = initial.length if initial is not None else 0
    position = start
    for span in spans:
        if span.start != position:
            raise ValueError(f"spans must be contiguous: expected a span at {position}, got {span.start}")
        position += span.length
    total_length = position

    recomputed_ids: list[int] = []
    recomputed_positions: list[int] = []
    offsets: list[tuple[int, int]] = []
    for span in spans:
        offsets.append((len(recomputed_ids), span.recompute))
        recomputed_ids.extend(span.token_ids[: span.recompute])
        recomputed_positions.extend(range(span.start, span.start + span.recompute))
    if not recomputed_ids:
        raise ValueError("nothing to recompute: the last span (the question) must have recomputed tokens")
    ids = torch.tensor(recomputed_ids, dtype=torch.long, device=device)
    query_index = torch.tensor(recomputed_positions, dtype=torch.long, device=device)
    key_index = torch.arange(total_length, device=device)

    hidden = model.backbone.embed_tokens(ids)  # [R, hidden]
    cos_all, sin_all = L.rotary_tables(model.backbone.rotary_emb, key_index, hidden)
    new_state = DecodeState(length=total_length)
    span_linear_states: list[dict[int, LinearLayerState]] = [dict() for _ in spans]
    compose_seconds = 0.0

    for layer_index, layer in enumerate(model.layers):
        x = layer.input_layernorm(hidden)
        if model.layer_types[layer_index] == LINEAR_LAYER:
            previous = initial.linear[layer_index] if initial is not None else None
            mixed, final_state, per_span, seconds = _linear_layer(
                layer.linear_attn, layer_index, x, spans, offsets, previous, options, want_checkpoints, dtype
            )
            compose_seconds += seconds
            new_state.linear[layer_index] = final_state
            for span_number, span_state in enumerate(per_span):
                span_linear_states[span_number][layer_index] = span_state
        else:
            attention = layer.self_attn
            query, key, value, gate = L.attention_inputs(attention, x)
            query = L.apply_rotary(query, cos_all[query_index], sin_all[query_index])
            key = L.apply_rotary(key, cos_all[query_index], sin_all[query_index])
            # K/V buffers indexed by position: the prefix state, fresh and cached tokens go straight to their place
            all_keys = key.new_empty(key.shape[0], total_length, key.shape[2])
            all_values = value.new_empty(value.shape[0], total_length, value.shape[2])
            if initial is not None:
                all_keys[:, :start] = initial.attention[layer_index].keys
                all_values[:, :start] = initial.attention[layer_index].values
            for span, (offset, count) in zip(spans, offsets):
                if count:
                    all_keys[:, span.start : span.start + count] = key[:, offset : offset + count]
                    all_values[:, span.start : span.start + count] = value[:, offset : offset + count]
                if span.entry is not None and count < span.length:
                    began = time.perf_counter()
                    at = span.start + count
                    all_values[:, at : span.start + span.length] = span.entry[tensor_name(layer_index, "value")][:, count:]
                    rotate_from = at if options.reposition_keys else count
                    _rotate_into(all_keys, at, span.entry[tensor_name(layer_index, "key")][:, count:], cos_all, sin_all, rotate_from)
                    compose_seconds += time.perf_counter() - began
            core = L.attention_core(attention, query, all_keys, all_values, query_index, key_index)
            mixed = L.attention_output(attention, core, gate)
            new_state.attention[layer_index] = AttentionLayerState(all_keys, all_values)
        hidden = hidden + mixed
        hidden = hidden + L.mlp_forward(layer, layer.post_attention_layernorm(hidden))

    checkpoints: list[DecodeState] = []
    if want_checkpoints:
        end = start
        for span, linear_states in zip(spans, span_linear_states):
            end += span.length
            checkpoint = DecodeState(length=end, linear=linear_states)
            for layer_index, attention_state in new_state.attention.items():
                checkpoint.attention[layer_index] = AttentionLayerState(
                    attention_state.keys[:, :end], attention_state.values[:, :end]
                )
            checkpoints.append(checkpoint)
    all_logits = model.logits(hidden) if want_all_logits else None
    logits = all_logits[-1] if all_logits is not None else model.logits(hidden[-1:])[0]
    return StackResult(
        logits=logits,
        state=new_state,
        recomputed_tokens=len(recomputed_ids),
        all_logits=all_logits,
        checkpoints=checkpoints,
        compose_seconds=compose_seconds,
    )


def _gather_runs(values: torch.Tensor, windows: list[tuple[int, int]]) -> torch.Tensor:
    """Rows (offset, count) of values [R, ...] as [n, longest, ...], each run zero-padded at its end."""
    longest = max(count for _, count in windows)
    out = values.new_zeros(len(windows), longest, *values.shape[1:])
    for row, (offset, count) in enumerate(windows):
        out[row, :count] = values[offset : offset + count]
    return out


def _linear_layer(
    mixer: torch.nn.Module,
    layer_index: int,
    x: torch.Tensor,
    spans: list[Span],
    offsets: list[tuple[int, int]],
    previous: LinearLayerState | None,
    options: StackOptions,
    want_checkpoints: bool,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, LinearLayerState, list[LinearLayerState], float]:
    """One Gated DeltaNet layer over the recomputed tokens x [R, hidden] laid out by `spans`.

    Projections run once for all recomputed tokens; each run's conv sees the running conv tail. When the plan
    has cached spans, every recomputed run but the last (the question) is evaluated in ONE batched call that also
    yields its affine map (identity-start trick); a scan over the runs' and cached spans' maps then gives every
    run's start state, and its outputs follow as o_zero + o_transition @ S_start. The last run starts from the
    scanned state directly. Returns (mixed [R, hidden], end state, per-span states if asked, compose seconds).
    """
    device = x.device
    compose_seconds = 0.0
    preconv, output_gate, b, a = L.linear_projections(mixer, x)
    tail = previous.conv_tail.float() if previous is not None else L.empty_conv_tail(mixer, device)
    run_numbers: list[int] = []
    contexts: list[torch.Tensor] = []
    tails_after: list[torch.Tensor] = []
    for span_number, (span, (offset, count)) in enumerate(zip(spans, offsets)):
        if count:
            run_numbers.append(span_number)
            contexts.append(tail)
            tail = L.advance_conv_tail(tail, preconv[offset : offset + count])
        if span.entry is not None and count < span.length:
            tail = _advance_tail_cached(tail, span.entry[tensor_name(layer_index, "conv_tail")], span.length - count)
        tails_after.append(tail)

    # conv + delta-rule inputs of every recomputed run in one batched call (runs zero-padded at the end)
    windows = [offsets[n] for n in run_numbers]
    lengths = [count for _, count in windows]
    query, key, value, log_decay, beta = L.batched_delta_rule_inputs(
        mixer, _gather_runs(preconv, windows), _gather_runs(b, windows), _gather_runs(a, windows),
        torch.stack(contexts), lengths,
    )
    row_of = {number: row for row, number in enumerate(run_numbers)}

    batched_numbers = run_numbers[:-1] if len(run_numbers) > 1 and any(s.entry is not None for s in spans) else []
    batched: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    if batched_numbers:
        rows = slice(0, len(batched_numbers))
        width = max(lengths[: len(batched_numbers)])
        zero_outputs, transition_outputs, maps = gated_delta_rule_with_transition(
            query[rows, :, :width], key[rows, :, :width], value[rows, :, :width], log_decay[rows, :, :width], beta[rows, :, :width]
        )
        for index, number in enumerate(batched_numbers):
            batched[number] = (zero_outputs[index], transition_outputs[index], maps.transition[index], maps.state[index])

    recurrent = (
        previous.recurrent.float()
        if previous is not None
        else torch.zeros(mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim, device=device)
    )
    core = torch.empty(mixer.num_v_heads, x.shape[0], mixer.head_v_dim, device=device)
    per_span: list[LinearLayerState] = []
    pending: list[tuple[dict[str, torch.Tensor], int]] = []  # cached remainders not yet applied: one call per run
    for span_number, (span, (offset, count)) in enumerate(zip(spans, offsets)):
        if pending and count:
            recurrent, seconds = _apply_pending(recurrent, pending, layer_index, options.composition)
            compose_seconds += seconds
        if count:
            if span_number in batched:
                zero_output, transition_output, transition, state = batched[span_number]
                core[:, offset : offset + count] = zero_output[:, :count] + transition_output[:, :count] @ recurrent
                recurrent = transition @ recurrent + state
            else:
                row = row_of[span_number]
                output, final = gated_delta_rule(
                    query[row : row + 1, :, :count], key[row : row + 1, :, :count], value[row : row + 1, :, :count],
                    log_decay[row : row + 1, :, :count], beta[row : row + 1, :, :count], recurrent[None],
                )
                core[:, offset : offset + count] = output[0]
                recurrent = final[0]
        if span.entry is not None and count < span.length:
            pending.append((span.entry, count))
            if want_checkpoints:
                recurrent, seconds = _apply_pending(recurrent, pending, layer_index, options.composition)
                compose_seconds += seconds
        if want_checkpoints:
            per_span.append(LinearLayerState(recurrent, tails_after[span_number]))
    if pending:
        recurrent, seconds = _apply_pending(recurrent, pending, layer_index, options.composition)
        compose_seconds += seconds
    mixed = L.linear_mixer_output(mixer, core, output_gate, dtype)
    return mixed, LinearLayerState(recurrent, tail), per_span, compose_seconds
