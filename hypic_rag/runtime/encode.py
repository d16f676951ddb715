"""Encode segments standalone (positions 0..L-1, zero start) into cache entries, for any family.

Per recurrent mixer the entry holds the affine map of the segment's suffix (tokens seam..L-1) — P (shaped by the
mixer's transition kind; Gated DeltaNet [H, K, K]) and Z [*state_shape] — and its conv tail; per attention mixer
the keys before any position and the values. See docs/CONTRACTS.md. No zero-start end state of the whole chunk
is stored (it would add half of Z+P's bytes): a segment at position 0 either has a seam-0 entry (then Z is that
state) or recomputes its seam from the zero start, which is exact.
"""

from __future__ import annotations

import torch

from hypic_rag.entry.schema import SEAM_TOKENS, TOKEN_IDS, Entry, check_seam_tokens, tensor_name
from hypic_rag.runtime import layers as L
from hypic_rag.runtime.blocks import BlockContext
from hypic_rag.runtime.mixers.base import AttentionMixer, Mixer, RecurrentMixer
from hypic_rag.runtime.model import HybridModel


@torch.no_grad()
def encode_segment(model: HybridModel, token_ids: list[int], seam_tokens: int) -> Entry:
    """The cache entry of `token_ids` [L] for seam window `seam_tokens` (CPU tensors, contiguous)."""
    if not token_ids:
        raise ValueError("cannot encode an empty segment")
    check_seam_tokens(seam_tokens)
    return _encode_batch(model, [list(token_ids)], seam_tokens)[0]


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
    return _encode_batch(model, segments, seam_tokens)


def _encode_recurrent(
    mixer: RecurrentMixer, x: torch.Tensor, lengths: list[int], seam: int, dtype: torch.dtype
) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]]]:
    """A recurrent mixer over n standalone segments x [n, L, hidden] (padded at their ends): the mixed output
    [n, L, hidden] and per part ("transition", "suffix_state", "conv_tail") one tensor per segment."""
    count, device = x.shape[0], x.device
    longest = x.shape[1]
    projections = mixer.project(x)
    empty_tail = mixer.empty_conv_tail(device)
    convolved = mixer.convolve(projections.preconv, empty_tail.expand(count, -1, -1))
    inputs = mixer.recurrence_inputs(convolved, projections, lengths)
    parts: dict[str, list[torch.Tensor]] = {
        "conv_tail": [L.advance_conv_tail(empty_tail, projections.preconv[row, :length]) for row, length in enumerate(lengths)]
    }
    everything = slice(0, count)
    if mixer.transition_kind is None:
        core, _ = mixer.run(inputs, None)
        return mixer.output(core, projections, dtype), parts
    pieces: list[torch.Tensor] = []
    seam_state = None
    if seam > 0:
        seam_output, seam_state = mixer.run(inputs.select(everything, 0, seam), None)
        pieces.append(seam_output)
    if seam < longest:
        suffix = mixer.run_with_transition(inputs.select(everything, seam, longest))
        suffix_output = suffix.zero_outputs
        if seam_state is not None:
            suffix_output = mixer.outputs_from_start(suffix.zero_outputs, suffix.transition_outputs, seam_state)
        pieces.append(suffix_output)
        segment = suffix.segment
    else:
        segment = mixer.identity_segment(count, device)
    core = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]  # [n, L, *output_shape]
    parts["transition"] = [segment.transition[row] for row in range(count)]
    parts["suffix_state"] = [segment.state[row] for row in range(count)]
    return mixer.output(core, projections, dtype), parts


def _encode_attention(
    mixer: AttentionMixer, x: torch.Tensor, lengths: list[int]
) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]]]:
    """An attention mixer over n standalone segments x [n, L, hidden] at positions 0..L-1: the mixed output and
    per segment its keys (before any position) and values [H_kv, length, D]."""
    positions = mixer.positions
    projections = mixer.project(x)  # [n, H, L, D]
    tables = positions.tables(torch.arange(x.shape[1], device=x.device), x)
    everywhere = slice(None)
    parts = {
        "key": [projections.key[row, :, :length] for row, length in enumerate(lengths)],
        "value": [projections.value[row, :, :length] for row, length in enumerate(lengths)],
    }
    core = L.causal_attention(
        mixer,
        positions.apply(projections.query, tables, everywhere),
        positions.apply(projections.key, tables, everywhere),
        projections.value,
    )
    return mixer.output(core, projections), parts


@torch.no_grad()
def entry_layout(model: HybridModel, length: int, seam_tokens: int) -> Entry:
    """The entry `encode_segment` makes for a chunk of `length` tokens, by the same code, left on the model's device.

    For a model built on the meta device (`with torch.device("meta"): AutoModelForCausalLM.from_config(config)`,
    then `wrap_model`) every tensor has its name, shape and dtype and no values: an entry's bytes
    (`hypic_rag.entry.schema.entry_bytes`) at a published checkpoint's shapes, without its weights
    (`hypic_rag.bench.families`). On a real device: the entry of `length` zero token ids.
    """
    if length < 1:
        raise ValueError("length must be >= 1")
    check_seam_tokens(seam_tokens)
    return _encode_batch(model, [[0] * length], seam_tokens, to_cpu=False)[0]


def _encode_batch(model: HybridModel, segments: list[list[int]], seam_tokens: int, to_cpu: bool = True) -> list[Entry]:
    """`encode_segments` without its checks: the segments as one padded batch through every block (entries on the
    CPU, contiguous; with `to_cpu` False, as the blocks left them)."""
    device = model.device
    lengths = [len(segment) for segment in segments]
    count, longest = len(segments), max(lengths)
    seam = min(seam_tokens, longest)
    ids = torch.zeros(count, longest, dtype=torch.long)
    for row, segment in enumerate(segments):
        ids[row, : len(segment)] = torch.tensor(segment, dtype=torch.long)
    hidden = model.embed(ids.to(device))  # [n, L, hidden]
    context = BlockContext(embeddings=hidden)
    entries: list[Entry] = [
        {TOKEN_IDS: torch.tensor(segment, dtype=torch.int64), SEAM_TOKENS: torch.tensor(seam_tokens, dtype=torch.int64)}
        for segment in segments
    ]
    for layer_index, block in enumerate(model.blocks):

        def mix(mixer: Mixer, x: torch.Tensor, layer_index: int = layer_index) -> torch.Tensor:
            if isinstance(mixer, RecurrentMixer):
                mixed, parts = _encode_recurrent(mixer, x, lengths, seam, model.dtype)
            else:
                mixed, parts = _encode_attention(mixer, x, lengths)
            for part, tensors in parts.items():
                for row, tensor in enumerate(tensors):
                    entries[row][tensor_name(layer_index, part)] = tensor
            return mixed

        hidden = block.forward(hidden, mix, context)
    if not to_cpu:
        return entries
    return [{name: tensor.detach().to("cpu").contiguous() for name, tensor in entry.items()} for entry in entries]
