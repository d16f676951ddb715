"""The GPU benchmark's models: one random model per mixer kind at about 2B parameters, shaped after a published
checkpoint of the family (`published_layouts.PUBLISHED_LAYOUTS`: its hidden size, layer pattern, heads and head
sizes, state sizes), with the MoE shrunk (fewer experts) where the release is larger than ~2B.

Three sizes of each, the same mixer head shapes in the first two (fla autotunes its kernels per number of heads and
head size, so the GPU tests' kernels are the ones the benchmark then reuses):
- "2b": the benchmark model (random weights, bf16, built straight on the GPU);
- "test": the GPU tests' model: the 2b model's mixers and heads, 4 layers (one attention layer), a 4096-token
  vocabulary and 2 experts, so a float32 copy is a quick reference;
- "tiny": the test suite's tiny config of the family (`hypic_rag.testing.tiny_config`): the CPU dry run.
"""

from __future__ import annotations

from typing import Any

import torch

from hypic_rag.bench.published_layouts import PUBLISHED_LAYOUTS

LINEAR, ATTENTION = "linear_attention", "full_attention"

QWEN3_5_2B: dict[str, Any] = {
    # Qwen3.5-2B-like (our reading of the family's small dense layout; random weights): 24 layers, 18 Gated DeltaNet
    # (16 key / 16 value heads x 128) + 6 gated attention (8 query / 2 KV heads x 256, partial rotary 1/4 with
    # interleaved M-RoPE sections), hidden 2048, MLP 6144, vocab 248320 with tied embeddings: 1.88B parameters.
    "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "intermediate_size": 6144, "max_position_embeddings": 32768, "tie_word_embeddings": True,
    "rope_parameters": {
        "rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
        "mrope_interleaved": True, "mrope_section": [11, 11, 10],
    },
}

GPU_MODELS: dict[str, dict[str, Any]] = {
    # mixer kind -> model type, the published checkpoint the shape follows, what differs from it at "2b"
    "gated_deltanet": {"model_type": "qwen3_5", "shape_of": "Qwen3.5-2B (layout as read; no hub config here)",
                       "settings": QWEN3_5_2B},
    "kda": {"model_type": "kimi_linear", "shape_of": "moonshotai/Kimi-Linear-48B-A3B-Instruct with 4 experts (not 256)",
            "settings": {"num_experts": 4, "num_experts_per_token": 2}},
    "ssd": {"model_type": "granitemoehybrid", "shape_of": "ibm-granite/granite-4.0-h-tiny with experts of 1024",
            "settings": {"intermediate_size": 1024, "num_local_experts": 8, "num_experts_per_tok": 2}},
    "lightning": {"model_type": "minimax",
                  "shape_of": "MiniMaxAI/MiniMax-Text-01-hf's heads of 128 and attention every 8th layer, at hidden "
                              "2048, 24 layers, 4 experts",
                  "settings": {"hidden_size": 2048, "num_hidden_layers": 24,
                               "layer_types": [ATTENTION if index % 8 == 7 else LINEAR for index in range(24)],
                               "num_attention_heads": 16, "head_dim": 128, "num_key_value_heads": 4,
                               "num_local_experts": 4, "intermediate_size": 2816}},
    "short_conv": {"model_type": "lfm2", "shape_of": "LiquidAI/LFM2-1.2B as published", "settings": {}},
    "selective_scan": {"model_type": "jamba",
                       "shape_of": "ai21labs/Jamba-v0.1's pattern (attention every 8th layer, MoE every 2nd, Mamba "
                                   "state 16, expand 2) at hidden 2048, 24 layers, 4 experts",
                       "settings": {"hidden_size": 2048, "num_hidden_layers": 24, "intermediate_size": 4096,
                                    "num_experts": 4, "num_attention_heads": 16, "num_key_value_heads": 4,
                                    "mamba_dt_rank": 128}},
}
"""In the order the benchmark runs them (the slowest transformers baseline, Jamba's, last)."""

MIXER_KINDS = tuple(GPU_MODELS)
SIZES = ("2b", "test", "tiny")

_TEST_LAYERS: dict[str, dict[str, Any]] = {
    # 4 layers with one attention layer, in each family's own config keys
    "gated_deltanet": {"num_hidden_layers": 4},
    "kda": {"num_hidden_layers": 4, "layer_types": [LINEAR, LINEAR, LINEAR, ATTENTION], "num_experts": 2},
    "ssd": {"num_hidden_layers": 4, "layer_types": [LINEAR, LINEAR, LINEAR, ATTENTION], "num_local_experts": 2},
    "lightning": {"num_hidden_layers": 4, "layer_types": [LINEAR, LINEAR, LINEAR, ATTENTION], "num_local_experts": 2},
    "short_conv": {"num_hidden_layers": 4, "full_attn_idxs": [3], "intermediate_size": 2048},
    "selective_scan": {"num_hidden_layers": 4, "attn_layer_period": 4, "attn_layer_offset": 3, "num_experts": 2},
}


def gpu_model_config(kind: str, size: str) -> Any:
    """The transformers config of `kind`'s model at `size` (see the module docstring)."""
    if kind not in GPU_MODELS:
        raise ValueError(f"unknown mixer kind {kind!r}; choose one of {', '.join(MIXER_KINDS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    spec = GPU_MODELS[kind]
    model_type = spec["model_type"]
    if size == "tiny":
        from hypic_rag.testing import tiny_config

        return tiny_config(model_type)
    settings = dict(spec["settings"])
    if size == "test":
        settings.update(_TEST_LAYERS[kind], vocab_size=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if model_type == "qwen3_5":
        from hypic_rag.testing import tiny_config

        return tiny_config("qwen3_5", initializer_range=0.02, **settings)
    from transformers import AutoConfig

    layout = PUBLISHED_LAYOUTS[model_type]
    return AutoConfig.for_model(layout.model_type, **{**layout.settings, **settings})


def count_parameters(config: Any) -> int:
    """Parameters of a model of `config`, built on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return sum(parameter.numel() for parameter in model.parameters())


def build_gpu_model(kind: str, size: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random causal LM of `kind` at `size`, eval mode. "2b": built straight on `device` in `dtype` with
    transformers' own initialisation (no float32 copy on the host); "test" / "tiny": the test suite's seeded
    build (`build_tiny_model`: slow decays, peaked attention) in float32, then moved to `device` / `dtype`."""
    from transformers import AutoModelForCausalLM

    config = gpu_model_config(kind, size)
    if size == "2b":
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return model.eval()
    from hypic_rag.testing import build_tiny_model

    return build_tiny_model(seed=seed, config=config).to(device=device, dtype=dtype).eval()
