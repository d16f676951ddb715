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
