"""Cache bytes per chunk at a published checkpoint's layer shapes, from the entry the runtime would make.

No weights: the checkpoint's transformers config (`published_layouts`) is instantiated on the meta device, wrapped
by its family adapter, and the runtime's own encoder (`runtime.encode.entry_layout`) runs over it, so every tensor
of the entry comes out with its name, shape and dtype and no values. Bytes are counted by `entry.entry_bytes`, the
one way the cache and the benchmarks size entries. Nothing here knows a family's tensor shapes.

Dtypes are the runtime's: the model in bfloat16 (what `load_model` runs a checkpoint in on CUDA), so keys and
values are bfloat16; P, Z and conv tails are float32 (composition runs in float32). `pz_bfloat16_total` is the
entry with P and Z cast to bfloat16 (the release before cache formats stored them so; every format's bytes:
`bench.cache_formats`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

import torch

from hypic_rag.bench.published_layouts import PUBLISHED_LAYOUTS, PublishedLayout
from hypic_rag.entry.schema import SEAM_TOKENS as SEAM_NAME
from hypic_rag.entry.schema import TOKEN_IDS, Entry, entry_bytes
from hypic_rag.runtime.mixers.base import AttentionMixer, RecurrentMixer
from hypic_rag.runtime.model import HybridModel

logger = logging.getLogger(__name__)

CHUNK_TOKENS = 256
SEAM_TOKENS = 8
MODEL_DTYPE = torch.bfloat16


POSITION_NAMES = {"RotaryPositions": "RoPE", "InterleavedTailRotary": "RoPE (interleaved, MLA's rope part)"}
"""How the runtime's positioners are named in the tables (a class not listed: its class name)."""


def meta_model(config: Any, dtype: torch.dtype = MODEL_DTYPE) -> HybridModel:
    """`config`'s causal LM on the meta device (shapes, no storage), wrapped by its family adapter."""
    from transformers import AutoModelForCausalLM

    from hypic_rag.runtime.model import wrap_model

    with torch.device("meta"):
        # batched experts: the meta kernel of grouped_mm takes bfloat16 only and eager calls nonzero (no shape changes)
        hf_model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation="batched_mm")
    return wrap_model(hf_model)


def layout_entry(model: HybridModel, chunk_tokens: int = CHUNK_TOKENS, seam_tokens: int = SEAM_TOKENS) -> Entry:
    """The entry the runtime encodes for a chunk of `chunk_tokens` tokens (meta tensors for a meta model)."""
    from hypic_rag.runtime.encode import entry_layout

    return entry_layout(model, chunk_tokens, seam_tokens)


def mixer_summary(model: HybridModel) -> dict[str, Any]:
    """Layer counts by kind, the recurrent mixers' transition kinds and whether attention re-positions keys."""
    transitions: Counter[str] = Counter()
    positions: set[str] = set()
    for block in model.blocks:
        for mixer in block.mixers:
            if isinstance(mixer, RecurrentMixer):
                transitions[f"{type(mixer).__name__} ({mixer.transition_kind or 'no state'})"] += 1
            elif isinstance(mixer, AttentionMixer):
                name = type(mixer.positions).__name__
                positions.add(POSITION_NAMES.get(name, name) if mixer.positions.moves_keys else "NoPE")
    return {
        "layers": len(model.blocks),
        "layer_kinds": dict(Counter(model.layer_types)),
        "recurrent_mixers": dict(transitions),
        "attention_positions": sorted(positions),
    }


def entry_sizes(entry: Entry) -> dict[str, int]:
    """Bytes by part: P (`transition`), Z (`suffix_state`), conv tails, linear state in all, K/V, total, and the
    total with P and Z stored in bfloat16 (all through `entry_bytes`)."""
    sizes = entry_bytes(entry)

    def part_bytes(part: str) -> int:
        return entry_bytes({name: t for name, t in entry.items() if name.endswith(f".{part}")}).linear_bytes

    lowered = {name: tensor.to(torch.bfloat16) if name.endswith((".transition", ".suffix_state"))
               and tensor.is_floating_point() else tensor for name, tensor in entry.items()}
    stored = entry_bytes(lowered)
    return {
        "transition": part_bytes("transition"),
        "suffix_state": part_bytes("suffix_state"),
        "conv_tail": part_bytes("conv_tail"),
        "linear_state": sizes.linear_bytes,
        "key_value": sizes.kv_bytes,
        "total": sizes.linear_bytes + sizes.kv_bytes,
        "pz_bfloat16_total": stored.linear_bytes + stored.kv_bytes,
    }


def published_row(layout: PublishedLayout, chunk_tokens: int = CHUNK_TOKENS) -> dict[str, Any]:
    """One family's row: checkpoint, source, mixers and bytes per `chunk_tokens`-token chunk (meta, no weights)."""
    began = time.perf_counter()
    model = meta_model(layout.config())
    entry = layout_entry(model, chunk_tokens)
    layer_tensors = {name: tensor for name, tensor in entry.items() if name not in (TOKEN_IDS, SEAM_NAME)}
    if any(tensor.device.type != "meta" for tensor in layer_tensors.values()):
        raise AssertionError("a meta model's entry holds a real tensor")  # nothing was computed
    shapes = {name: [list(tensor.shape), str(tensor.dtype).removeprefix("torch.")]
              for name, tensor in layer_tensors.items()}
    row = {
        "model_type": model.config.model_type,
        "checkpoint": layout.checkpoint,
        "source": layout.source,
        "settings": layout.settings,
        "chunk_tokens": chunk_tokens,
        "model_dtype": str(model.dtype).removeprefix("torch."),
        **mixer_summary(model),
        "bytes": entry_sizes(entry),
        "entry_tensors": shapes,
        "seconds": time.perf_counter() - began,
    }
    del model, entry
    return row


def published_rows(model_types: list[str] | None = None, chunk_tokens: int = CHUNK_TOKENS) -> list[dict[str, Any]]:
    """`published_row` for each family of `model_types` (default: every published layout)."""
    names = list(PUBLISHED_LAYOUTS) if model_types is None else model_types
    rows = []
    for name in names:
        logger.info("bytes per chunk at the shapes of %s", PUBLISHED_LAYOUTS[name].checkpoint)
        rows.append(published_row(PUBLISHED_LAYOUTS[name], chunk_tokens))
    return rows
