"""Published checkpoints' layer shapes, one per family, as transformers config values (no weights).

`PUBLISHED_LAYOUTS[model_type]` names a released checkpoint of the family, says where its shape values come from,
and holds the config values that decide a cache entry's shapes (layer pattern, hidden size, heads and head sizes,
state sizes, conv kernels). Every other value is transformers 5.24's default for the config class: it does not
change an entry. `PublishedLayout.config()` builds the transformers config; `hypic_rag.bench.family_bytes` builds
the model on the meta device from it and asks the runtime's own encoder for the entry's tensors.

Provenance is recorded per checkpoint, plainly: "transformers' defaults" means the config class's defaults, whose
docstring names that checkpoint (docs/families_linear.md, docs/families_ssm.md say what was compared); "from
memory" values were not checked against the hub file (no network here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class PublishedLayout:
    """model_type: the transformers `config.model_type` to build; checkpoint: the hub name of the released model;
    source: where the values come from; settings: config values that differ from transformers' defaults."""

    model_type: str
    checkpoint: str
    source: str
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.model_type or not self.checkpoint or not self.source:
            raise ValueError("a published layout needs a model type, a checkpoint name and a source")

    def config(self) -> Any:
        """The transformers config of the checkpoint's text model (defaults + `settings`)."""
        from transformers import AutoConfig

        return AutoConfig.for_model(self.model_type, **self.settings)


def _every(count: int, period: int, offset: int, hit: str, other: str) -> list[str]:
    """`count` layer kinds: `hit` where index % period == offset, else `other`."""
    return [hit if index % period == offset else other for index in range(count)]


LINEAR, ATTENTION = "linear_attention", "full_attention"

PUBLISHED_LAYOUTS: dict[str, PublishedLayout] = {
    layout.model_type: layout
    for layout in (
        PublishedLayout(
            "qwen3_5_moe_text", "Qwen/Qwen3.5-35B-A3B",
            "transformers' Qwen3_5MoeTextConfig defaults (its docstring names this checkpoint; docs/cache.md)",
        ),
        PublishedLayout(
            "qwen3_next", "Qwen/Qwen3-Next-80B-A3B-Instruct",
            "transformers' Qwen3NextConfig defaults (its docstring names this checkpoint)",
        ),
        PublishedLayout(
            "granitemoehybrid", "ibm-granite/granite-4.0-h-tiny",
            "docs/families_ssm.md: SSD sizes from a copy of its config.json, attention heads and the attention "
            "layer indices from memory",
            {"hidden_size": 1536, "num_hidden_layers": 40,
             "layer_types": [ATTENTION if index in (5, 15, 25, 35) else LINEAR for index in range(40)],
             "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4,
             "mamba_expand": 2, "num_attention_heads": 12, "num_key_value_heads": 4,
             "position_embedding_type": "nope"},
        ),
        PublishedLayout(
            "lfm2", "LiquidAI/LFM2-1.2B",
            "docs/families_linear.md, from memory of the hub config (not checked against it)",
            {"hidden_size": 2048, "num_hidden_layers": 16, "full_attn_idxs": [2, 5, 8, 10, 12, 14],
             "num_attention_heads": 32, "num_key_value_heads": 8, "conv_L_cache": 3},
        ),
        PublishedLayout(
            "kimi_linear", "moonshotai/Kimi-Linear-48B-A3B-Instruct",
            "transformers' KimiLinearConfig defaults (its docstring names this checkpoint; docs/families_linear.md) "
            "with the published MLA layers (full_attn_layers 4, 8, ..., 24, 27, 1-indexed; from memory)",
            {"layer_types": [ATTENTION if index in (3, 7, 11, 15, 19, 23, 26) else LINEAR for index in range(27)]},
        ),
        PublishedLayout(
            "bailing_hybrid", "inclusionAI/Ling-3.0-Flash",
            "transformers' BailingHybridConfig defaults (its docstring names this checkpoint; not checked against "
            "the hub config)",
        ),
        PublishedLayout(
            "olmo_hybrid", "allenai/Olmo-Hybrid-7B",
            "transformers' OlmoHybridConfig defaults (its docstring names this checkpoint; not checked against the "
            "hub config), NoPE as released (rope_theta null)",
            {"rope_parameters": {"rope_type": "default", "rope_theta": None}},
        ),
        PublishedLayout(
            "minimax", "MiniMaxAI/MiniMax-Text-01-hf",
            "docs/families_linear.md, from memory (softmax attention every 8th layer)",
            {"hidden_size": 6144, "num_hidden_layers": 80, "layer_types": _every(80, 8, 7, ATTENTION, LINEAR),
             "num_attention_heads": 64, "head_dim": 128, "num_key_value_heads": 8, "num_local_experts": 32,
             "block_size": 256},
        ),
        PublishedLayout(
            "jamba", "ai21labs/Jamba-v0.1",
            "transformers' JambaConfig defaults (its docstring names this checkpoint; docs/families_ssm.md compared "
            "them with its config.json)",
        ),
        PublishedLayout(
            "bamba", "ibm-ai-platform/Bamba-9B",
            "docs/families_ssm.md, from its config.json (attention at 9, 18, 27; SSD state 128)",
            {"attn_layer_indices": [9, 18, 27], "mamba_d_state": 128, "mamba_n_heads": 128, "mamba_d_head": 64,
             "mamba_n_groups": 1},
        ),
        PublishedLayout(
            "nemotron_h", "nvidia/Nemotron-H-8B-Base-8K",
            "its config.json as quoted in public code (52-character hybrid_override_pattern: 24 Mamba2, 4 "
            "attention, 24 MLP layers; SSD 128 heads x 64, state 128, 8 groups)",
            {"hidden_size": 4096, "num_hidden_layers": 52,
             "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "mamba_num_heads": 128,
             "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4, "expand": 2},
        ),
        PublishedLayout(
            "falcon_h1", "tiiuae/Falcon-H1-1.5B-Instruct",
            "docs/families_ssm.md: layers, hidden and heads from transformers' docs table; SSD heads 48 x 64, state "
            "256, 1 group from memory",
            {"hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2,
             "head_dim": 128, "mamba_d_ssm": 3072, "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_d_state": 256,
             "mamba_n_groups": 1, "mamba_d_conv": 4},
        ),
        PublishedLayout(
            "zamba2", "Zyphra/Zamba2-2.7B",
            "transformers' Zamba2Config defaults (its docstring names this checkpoint) with the config.json's 80 "
            "SSD heads of 64 and 2 shared blocks (docs/families_ssm.md)",
            {"n_mamba_heads": 80, "num_mem_blocks": 2, "use_shared_attention_adapter": False},
        ),
    )
}
"""One published checkpoint per family, by model type (Qwen3.5 by its MoE text config)."""
