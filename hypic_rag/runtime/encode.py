"""Encode one segment standalone (positions 0..L-1, zero start) into a cache entry.

Per linear layer the entry holds the affine map of the segment's suffix (tokens seam..L-1) — P [H, K, K] and
Z [H, K, V] — and its conv tail; per attention layer the pre-RoPE keys and the values. See docs/CONTRACTS.md.
No zero-start end state of the whole chunk is stored (it would add half of Z+P's bytes): a segment at position 0
either has a seam-0 entry (then Z is that state) or recomputes its seam from the zero start, which is exact.
"""

from __future__ import annotations

import torch

from hypic_rag.entry import LINEAR_LAYER, SEAM_TOKENS, TOKEN_IDS, Entry, check_seam_tokens, tensor_name
from hypic_rag.runtime import layers as L
from hypic_rag.runtime.model import HybridModel
from hypic_rag.runtime.ops.gated_delta_rule import gated_delta_rule, gated_delta_rule_with_transition


@torch.no_grad()
def encode_segment(model: HybridModel, token_ids: list[int], seam_tokens: int) -> Entry:
    """The cache entry of `token_ids` [L] for seam window `seam_tokens` (CPU tensors, contiguous)."""
    if not token_ids:
        raise ValueError("cannot encode an empty segment")
    check_seam_tokens(seam_tokens)
    device = model.device
    length = len(token_ids)
    seam = min(seam_tokens, length)
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    positions = torch.arange(length, device=device)
    hidden = model.backbone.embed_tokens(ids)
    cos, sin = L.rotary_tables(model.backbone.rotary_emb, positions, hidden)
    entry: Entry = {
        TOKEN_IDS: torch.tensor(token_ids, dtype=torch.int64),
        SEAM_TOKENS: torch.tensor(seam_tokens, dtype=torch.int64),
    }
    for layer_index, layer in enumerate(model.layers):
        x = layer.input_layernorm(hidden)
        if model.layer_types[layer_index] == LINEAR_LAYER:
            mixer = layer.linear_attn
            inputs = L.linear_mixer_inputs(mixer, x, L.empty_conv_tail(mixer, device))
            parts = (inputs.query, inputs.key, inputs.value, inputs.log_decay, inputs.beta)
            seam_output, seam_state = gated_delta_rule(*(p[None, :, :seam] for p in parts))
            suffix_zero, suffix_transition, suffix = gated_delta_rule_with_transition(*(p[None, :, seam:] for p in parts))
            suffix_output = suffix_zero + suffix_transition @ seam_state
            core = torch.cat([seam_output, suffix_output], dim=2)[0]
            entry[tensor_name(layer_index, "transition")] = suffix.transition[0]
            entry[tensor_name(layer_index, "suffix_state")] = suffix.state[0]
            entry[tensor_name(layer_index, "conv_tail")] = L.advance_conv_tail(
                L.empty_conv_tail(mixer, device), inputs.preconv
            )
            mixed = L.linear_mixer_output(mixer, core, inputs.output_gate, model.dtype)
        else:
            attention = layer.self_attn
            query, key, value, gate = L.attention_inputs(attention, x)
            entry[tensor_name(layer_index, "key")] = key
            entry[tensor_name(layer_index, "value")] = value
            core = L.attention_core(
                attention, L.apply_rotary(query, cos, sin), L.apply_rotary(key, cos, sin), value, positions, positions
            )
            mixed = L.attention_output(attention, core, gate)
        hidden = hidden + mixed
        hidden = hidden + L.mlp_forward(layer, layer.post_attention_layernorm(hidden))
    return {name: tensor.detach().to("cpu").contiguous() for name, tensor in entry.items()}


DEFAULT_ENCODE_BATCH_TOKENS = 1024
"""Padded tokens per batched encoding forward: enough rows to fill the matmuls (on 2 CPU cores 1024 encoded
tiny segments as fast as 4096), and short enough that a request past its deadline stops soon (a check runs
between batches)."""


def plan_encode_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices of segments grouped for `encode_segments`: longest first (so the padding inside a batch is small
    and the long ones start early), each batch at most `batch_tokens` padded tokens (a longer segment goes alone).
    A pure function of `lengths`, so the same segments always form the same batches."""
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    batches: list[list[int]] = []
    for index in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


@torch.no_grad()
def encode_segments(model: HybridModel, segments: list[list[int]], seam_tokens: int) -> list[dict[str, torch.Tensor]]:
    """Entries of several segments in ONE forward: each segment from a zero state at positions 0..L_i-1.

    The segments are laid out as a padded batch [n, L_max]; padding sits at each segment's end, where causal
    attention, the causal conv and identity delta-rule steps (decay 1, write strength 0) keep it from touching the
    segment's own tokens. Equal to `encode_segment` per segment up to float32 round-off (a test checks 1e-5).
    Projections, MLPs and attention run over all segments at once, which is what makes encoding fast on any device.
    """
    if not segments:
        return []
    if any(not segment for segment in segments):
        raise ValueError("cannot encode an empty segment")
    if seam_tokens < 0:
        raise ValueError("seam_tokens must be >= 0")
    if len(segments) == 1:
        return [encode_segment(model, segments[0], seam_tokens)]
    device = model.device
    lengths = [len(segment) for segment in segments]
    count, longest = len(segments), max(lengths)
    seam = min(seam_tokens, longest)
    ids = torch.zeros(count, longest, dtype=torch.long)
    for row, segment in enumerate(segments):
        ids[row, : len(segment)] = torch.tensor(segment, dtype=torch.long)
    ids = ids.to(device)
    hidden = model.backbone.embed_tokens(ids)  # [n, L, hidden]
    cos, sin = L.rotary_tables(model.backbone.rotary_emb, torch.arange(longest, device=device), hidden[0])
    entries: list[dict[str, torch.Tensor]] = [
        {TOKEN_IDS: torch.tensor(segment, dtype=torch.int64), SEAM_TOKENS: torch.tensor(seam_tokens, dtype=torch.int64)}
        for segment in segments
    ]
    for layer_index, layer in enumerate(model.layers):
        x = layer.input_layernorm(hidden)
        if model.layer_types[layer_index] == LINEAR_LAYER:
            mixer = layer.linear_attn
            preconv, output_gate, b, a = L.linear_projections(mixer, x)
            zero_context = L.empty_conv_tail(mixer, device).expand(count, -1, -1)
            parts = L.batched_delta_rule_inputs(mixer, preconv, b, a, zero_context, lengths)
            seam_output, seam_state = gated_delta_rule(*(p[:, :, :seam] for p in parts))
            suffix_zero, suffix_transition, suffix = gated_delta_rule_with_transition(*(p[:, :, seam:] for p in parts))
            core = torch.cat([seam_output, suffix_zero + suffix_transition @ seam_state], dim=2)  # [n, H, L, V]
            for row, length in enumerate(lengths):
                entries[row][tensor_name(layer_index, "transition")] = suffix.transition[row]
                entries[row][tensor_name(layer_index, "suffix_state")] = suffix.state[row]
                entries[row][tensor_name(layer_index, "conv_tail")] = L.advance_conv_tail(
                    L.empty_conv_tail(mixer, device), preconv[row, :length]
                )
            mixed = L.linear_mixer_output(mixer, core, output_gate, model.dtype)
        else:
            attention = layer.self_attn
            query, key, value, gate = L.attention_inputs(attention, x)  # [n, H, L, D]
            for row, length in enumerate(lengths):
                entries[row][tensor_name(layer_index, "key")] = key[row, :, :length]
                entries[row][tensor_name(layer_index, "value")] = value[row, :, :length]
            core = L.causal_attention(attention, L.apply_rotary(query, cos, sin), L.apply_rotary(key, cos, sin), value)
            mixed = L.attention_output(attention, core, gate)
        hidden = hidden + mixed
        hidden = hidden + L.mlp_forward(layer, layer.post_attention_layernorm(hidden))
    return [{name: tensor.detach().to("cpu").contiguous() for name, tensor in entry.items()} for entry in entries]
