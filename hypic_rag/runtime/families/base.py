"""A family adapter: how one architecture's transformers model becomes the runtime's blocks, and the registry of
adapters by `config.model_type`.

The runtime (stack, encoder, engine, cache, entry format) never asks which family a model is: everything that
differs lives in an adapter, which builds `runtime.blocks.Block`s over the model's own modules and says how
tokens are embedded and how logits come out (embedding / logit multipliers included). A family registers with
`register_family`; `family_for(model_type)` finds it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from hypic_rag.runtime.blocks import Block
from hypic_rag.runtime.mixers.attention import RotaryPositions
from hypic_rag.runtime.mixers.base import NoPositions, Positioner


def text_backbone(hf_model: nn.Module) -> nn.Module:
    """The decoder stack of a causal LM: `model` (…ForCausalLM) or `model.language_model` (…ForConditionalGeneration)."""
    inner = getattr(hf_model, "model", None)
    return getattr(inner, "language_model", inner) if inner is not None else hf_model


class Family(ABC):
    """One architecture. `model_types`: the `config.model_type` values it serves (text configs included)."""

    model_types: tuple[str, ...] = ()
    embeddings_name: str = "embed_tokens"
    """The backbone's token embedding module (`embeddings` in Nemotron-H)."""
    final_norm_name: str = "norm"
    """The backbone's final norm (`final_layernorm` in Jamba, Bamba, Falcon-H1, Zamba2; `norm_f` in Nemotron-H)."""
    layer_kinds_field: str = "layer_types"
    """The config list naming each layer's kind (`layers_block_type` in Jamba, Bamba, Nemotron-H)."""
    known_layer_kinds: tuple[str, ...] = ()
    """The layer kinds this family builds blocks for (empty: the config's layer kinds are not checked)."""
    needs_rotary_embedding: bool = False
    """Whether the backbone must have a rotary embedding (`rotary_emb`) for its attention layers."""

    def unsupported_reason(self, config: Any) -> str | None:
        """Why this runtime cannot serve a model of `config` (one line), or None when it can: by default a layer
        kind outside `known_layer_kinds`."""
        kinds = getattr(config, self.layer_kinds_field) if self.known_layer_kinds else ()
        unknown = sorted({kind for kind in kinds if kind not in self.known_layer_kinds})
        return f"unknown layer type {unknown[0]!r}" if unknown else None

    def backbone(self, hf_model: nn.Module) -> nn.Module:
        """The decoder stack (its embeddings, layers, final norm)."""
        return text_backbone(hf_model)

    def structure_problem(self, hf_model: nn.Module) -> str | None:
        """Why `hf_model` is not a causal LM of this family the runtime can drive, or None."""
        backbone = self.backbone(hf_model)
        parts = [getattr(backbone, name, None) for name in (self.embeddings_name, "layers", self.final_norm_name)]
        if any(part is None for part in parts) or getattr(hf_model, "lm_head", None) is None:
            return (
                f"{type(hf_model).__name__} is not a causal LM with a language-model head; pass a ...ForCausalLM or "
                "...ForConditionalGeneration model"
            )
        if self.needs_rotary_embedding and getattr(backbone, "rotary_emb", None) is None:
            return f"{type(hf_model).__name__} has no rotary embedding"
        return None

    def positions(self, hf_model: nn.Module) -> Positioner:
        """How the attention layers position queries and keys: RoPE through the backbone's rotary module when it
        has one, else none (NoPE)."""
        rotary = getattr(self.backbone(hf_model), "rotary_emb", None)
        return NoPositions() if rotary is None else RotaryPositions(rotary)

    @abstractmethod
    def build_blocks(self, hf_model: nn.Module) -> tuple[Block, ...]:
        """The model's decoder layers as blocks, in order (one per layer)."""

    def embed(self, hf_model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: ids [...] -> [..., hidden] (families with an embedding multiplier override)."""
        return getattr(self.backbone(hf_model), self.embeddings_name)(ids)

    def logits(self, hf_model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden [..., hidden] -> logits [..., vocab] (float32)."""
        return hf_model.lm_head(getattr(self.backbone(hf_model), self.final_norm_name)(hidden)).float()


_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Register `family` for each of its model types (ValueError if one is taken by another family)."""
    for model_type in family.model_types:
        existing = _FAMILIES.get(model_type)
        if existing is not None and existing is not family:
            raise ValueError(f"model type {model_type!r} is already served by {type(existing).__name__}")
        _FAMILIES[model_type] = family
    return family


def family_for(model_type: str | None) -> Family | None:
    """The family registered for `model_type`, or None."""
    return _FAMILIES.get(model_type) if model_type is not None else None


def supported_model_types() -> tuple[str, ...]:
    """Every registered model type, in registration order."""
    return tuple(_FAMILIES)
