"""Random timing models of each family, about 100-200M parameters (`hypic-rag bench --families`).

Each is the family's tiny test config (`hypic_rag.testing.tiny_config`: its mixers, blocks, multipliers, MoE
routing) scaled up: vocabulary 32000, hidden 768, 12 layers with the published models' mix of mixers (about one
attention layer in four to eight; Falcon-H1 has both in every layer; Nemotron-H interleaves MLP-only layers; Zamba2,
whose Mamba layers have no MLP, has 30 layers), heads of 64, MoE with 8 small experts (top 2). Weights drawn at transformers' scale (initializer_range 0.02); float32.
`qwen3_5` is the standard benchmark's timing model (`bench.timing_model`, 174M), for reference.
"""

from __future__ import annotations

from typing import Any

LINEAR, ATTENTION = "linear_attention", "full_attention"
HIDDEN, LAYERS, VOCABULARY = 768, 12, 32000


def _attention_at(*indices: int, layers: int = LAYERS, other: str = LINEAR) -> list[str]:
    return [ATTENTION if index in indices else other for index in range(layers)]


def _nemotron_h_pattern() -> list[str]:
    """12 Mamba2 layers each followed by an MLP layer, attention after the 4th and 9th Mamba2 (Nemotron-H-8B's
    M-M-M-M*-... at half depth): 26 layers."""
    kinds: list[str] = []
    for index in range(12):
        kinds.append(LINEAR)
        if index in (3, 8):
            kinds.append(ATTENTION)
        else:
            kinds.append("mlp")
    return kinds


_MOE = {"num_experts_per_tok": 2}
_KDA_MLA = {
    "linear_num_heads": 12, "linear_head_dim": 64, "num_attention_heads": 12, "num_key_value_heads": 12,
    "kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64, "intermediate_size": 2048,
    "moe_intermediate_size": 256, "num_local_experts": 8, "n_shared_experts": 1, **_MOE,
}

FAMILY_TIMING_MODELS: dict[str, dict[str, Any]] = {
    "granitemoehybrid": {
        "layer_types": _attention_at(5, 11), "num_attention_heads": 12, "num_key_value_heads": 4,
        "mamba_n_heads": 24, "mamba_n_groups": 1, "mamba_d_state": 64, "mamba_chunk_size": 256,
        "num_local_experts": 8, "intermediate_size": 256, "shared_intermediate_size": 1024, **_MOE,
    },
    "lfm2": {
        "layer_types": _attention_at(2, 5, 8, 11, other="conv"), "num_attention_heads": 12,
        "num_key_value_heads": 4, "intermediate_size": 2048,
    },
    "kimi_linear": {"layer_types": _attention_at(3, 7, 11), **_KDA_MLA},
    "bailing_hybrid": {
        "layer_types": _attention_at(5, 11), "head_dim": 64, "n_group": 2, "topk_group": 1,
        **{key: value for key, value in _KDA_MLA.items() if key not in ("linear_num_heads", "linear_head_dim")},
    },
    "olmo_hybrid": {
        "layer_types": _attention_at(3, 7, 11), "num_attention_heads": 12, "num_key_value_heads": 12,
        "linear_num_key_heads": 12, "linear_num_value_heads": 12, "linear_key_head_dim": 48,
        "linear_value_head_dim": 96, "intermediate_size": 2048,
    },
    "minimax": {
        "layer_types": _attention_at(5, 11), "num_attention_heads": 12, "head_dim": 64, "num_key_value_heads": 4,
        "num_local_experts": 8, "intermediate_size": 384, "block_size": 256, **_MOE,
    },
    "jamba": {
        "attn_layer_period": 6, "attn_layer_offset": 3, "num_attention_heads": 12, "num_key_value_heads": 4,
        "num_experts": 8, "intermediate_size": 512, "mamba_d_state": 16, "mamba_dt_rank": 48, **_MOE,
    },
    "bamba": {
        "attn_layer_indices": [5, 11], "num_attention_heads": 12, "num_key_value_heads": 4, "mamba_n_heads": 24,
        "mamba_n_groups": 1, "mamba_d_state": 64, "mamba_chunk_size": 256, "intermediate_size": 2048,
    },
    "nemotron_h": {
        "layers_block_type": _nemotron_h_pattern(), "num_attention_heads": 12, "num_key_value_heads": 4,
        "head_dim": 64, "mamba_num_heads": 24, "mamba_head_dim": 64, "n_groups": 4, "ssm_state_size": 64,
        "chunk_size": 256, "intermediate_size": 2048,
    },
    "falcon_h1": {
        "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64, "mamba_n_heads": 24,
        "mamba_n_groups": 1, "mamba_d_state": 64, "mamba_chunk_size": 256, "intermediate_size": 2048,
    },
    "zamba2": {
        "layers_block_type": ["hybrid" if index % 6 == 5 else LINEAR for index in range(30)],
        "num_attention_heads": 12, "num_key_value_heads": 12, "n_mamba_heads": 24, "mamba_ngroups": 1,
        "mamba_d_state": 64, "chunk_size": 256, "use_shared_attention_adapter": False, "intermediate_size": 2048,
    },
}
"""Per family: the tiny config's values replaced for the timing model (besides vocabulary, hidden, layers and
initializer_range, set for all)."""

TIMING_FAMILIES = ("qwen3_5", *FAMILY_TIMING_MODELS)


def family_timing_config(model_type: str, *, tiny: bool = False) -> Any:
    """The transformers config of `model_type`'s timing model (`tiny`: the test suite's tiny config instead)."""
    from hypic_rag.bench.timing_model import TIMING_MODELS
    from hypic_rag.testing import tiny_config

    if model_type not in TIMING_FAMILIES:
        raise ValueError(f"no timing model for {model_type!r}; choose one of {', '.join(TIMING_FAMILIES)}")
    if tiny:
        return tiny_config(model_type)
    if model_type == "qwen3_5":
        return tiny_config("qwen3_5", initializer_range=0.05, **TIMING_MODELS["medium"])
    overrides = dict(FAMILY_TIMING_MODELS[model_type])
    kinds = overrides.get("layer_types") or overrides.get("layers_block_type")
    layers = len(kinds) if kinds is not None else LAYERS
    return tiny_config(model_type, vocab_size=VOCABULARY, num_hidden_layers=layers, hidden_size=HIDDEN,
                       initializer_range=0.02, **overrides)


def build_family_timing_model(model_type: str, *, seed: int = 0, tiny: bool = False) -> Any:
    """A seeded random causal LM of `model_type`'s timing model (slow decays, peaked attention), eval, float32."""
    from hypic_rag.testing import build_tiny_model

    return build_tiny_model(model_type, seed=seed, config=family_timing_config(model_type, tiny=tiny))
