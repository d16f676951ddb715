"""Tiny random Mamba-family hybrids (jamba, bamba, nemotron_h, falcon_h1, zamba2) for tests and benchmarks, and
shrunken stand-ins of their hub checkpoints in the published layout (config.json keys and safetensors names as the
hub releases have them). `hypic_rag.testing.tiny_config` / `build_tiny_model` dispatch here for these types.

Tiny configs: hidden 64, 4 layers with attention in the middle one (jamba: layer 2; nemotron_h: its pattern), conv
kernel 4, weights drawn with initializer_range 0.2 (as the Granite tiny config) so that the modes' deviations are far
above float32 round-off. `adjust_ssm_model` gives the recurrent layers slow decays (so composition bugs cannot hide
behind fast forgetting).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

SSM_TINY_TYPES = ("jamba", "bamba", "nemotron_h", "falcon_h1", "zamba2")
"""Model types whose tiny configs this module writes."""


def _jamba_config(vocab_size: int, num_hidden_layers: int, overrides: dict[str, Any]):
    """Jamba: Mamba1 (D = 2 x 64, N 8, dt rank 4), attention at layer 2 of every 4 (NoPE, 4 heads / 2 KV), MoE (4
    experts, top 2) on odd layers, SwiGLU MLP on even ones."""
    from transformers import JambaConfig

    settings: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "attn_layer_period": 4, "attn_layer_offset": 2,
        "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2,
        "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 4,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "initializer_range": 0.2,
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
    }
    settings.update(overrides)
    return JambaConfig(**settings)


def _middle_attention(num_hidden_layers: int) -> list[int]:
    """The attention layer indices of a tiny stack: the middle layer (none in a one-layer stack)."""
    return [num_hidden_layers // 2] if num_hidden_layers > 1 else []


def _bamba_config(vocab_size: int, num_hidden_layers: int, overrides: dict[str, Any]):
    """Bamba: Mamba2 (4 heads of 32, 2 groups of B/C, N 16, chunk 16), attention in the middle layer (4 heads of
    16 / 2 KV, partial RoPE on half of each head), SwiGLU MLP."""
    from transformers import BambaConfig

    settings: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "attn_layer_indices": _middle_attention(num_hidden_layers),
        "mamba_n_heads": 4, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
        "mamba_chunk_size": 16, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "initializer_range": 0.2, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
    }
    settings.update(overrides)
    return BambaConfig(**settings)


def _nemotron_h_config(vocab_size: int, num_hidden_layers: int, overrides: dict[str, Any]):
    """Nemotron-H: `num_hidden_layers` mixer layers, Mamba2 (4 heads of 32, 2 groups, N 16, chunk 16) with NoPE
    attention in the middle one; with more than one, an MoE layer (4 routed experts, top 2, one shared) after the
    first and a squared-ReLU MLP layer at the end (so 4 gives M E M * M -)."""
    from transformers import NemotronHConfig

    kinds = ["linear_attention"] * num_hidden_layers
    if num_hidden_layers > 1:
        kinds[num_hidden_layers // 2] = "full_attention"
        kinds = [kinds[0], "moe", *kinds[1:], "mlp"]
    settings: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": 64, "layers_block_type": kinds, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "mamba_num_heads": 4,
        "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4, "chunk_size": 16,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
        "moe_shared_expert_intermediate_size": 48, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "initializer_range": 0.2, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
    }
    settings.update(overrides)
    return NemotronHConfig(**settings)


def _falcon_h1_config(vocab_size: int, num_hidden_layers: int, overrides: dict[str, Any]):
    """Falcon-H1: every layer Mamba2 (4 heads of 32, 2 groups, N 16, chunk 16, gated norm normalising before the
    gate) beside RoPE attention (4 heads of 16 / 2 KV), SwiGLU MLP; every muP multiplier away from 1 (embedding,
    logits, key, attention in / out, ssm in / out, the five ssm slices, MLP gate / down) so that a missed one shows."""
    from transformers import FalconH1Config

    settings: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "mamba_d_ssm": None,
        "mamba_n_heads": 4, "mamba_d_head": "auto", "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_d_conv": 4,
        "mamba_expand": 2, "mamba_chunk_size": 16, "mamba_rms_norm": True, "mamba_norm_before_gate": True,
        "embedding_multiplier": 2.0, "lm_head_multiplier": 0.5, "key_multiplier": 0.7,
        "attention_in_multiplier": 1.1, "attention_out_multiplier": 0.9, "ssm_in_multiplier": 1.2,
        "ssm_out_multiplier": 0.8, "ssm_multipliers": [0.9, 1.1, 1.2, 0.8, 1.3], "mlp_multipliers": [0.8, 1.2],
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "initializer_range": 0.2,
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
    }
    settings.update(overrides)
    return FalconH1Config(**settings)


def _zamba2_config(vocab_size: int, num_hidden_layers: int, overrides: dict[str, Any]):
    """Zamba2: every layer Mamba2 (4 heads of 32, 2 groups, N 16, chunk 16), every odd layer also hybrid: one shared
    transformer block (4 heads of 32 over concat(h, e) [128], NoPE unless use_mem_rope) with per-layer q/k/v
    adapters (rank 8) and MLP adapters. KV heads = heads, as published: transformers' k/v adapters are 2h wide, so
    grouped KV heads with adapters do not run there. Tied word embeddings, as published: transformers 5.24 ties the
    shared blocks across hybrid layers only when `tie_word_embeddings` is set (else each layer gets its own copy).
    initializer_range 0.1, not 0.2: attention over concat(h, e) with 0.2 weights amplifies float32 round-off to
    ~3e-5 in the logits between two exact evaluation orders (1.4e-6 at 0.1)."""
    from transformers import Zamba2Config

    kinds = ["hybrid" if index % 2 == 1 else "linear_attention" for index in range(num_hidden_layers)]
    settings: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": num_hidden_layers,
        "layers_block_type": kinds, "num_attention_heads": 4, "num_key_value_heads": 4, "n_mamba_heads": 4,
        "mamba_ngroups": 2, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "chunk_size": 16,
        "num_mem_blocks": 1, "use_shared_attention_adapter": True, "adapter_rank": 8, "use_mem_rope": False,
        "max_position_embeddings": 4096, "tie_word_embeddings": True, "initializer_range": 0.1,
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
    }
    settings.update(overrides)
    return Zamba2Config(**settings)


_CONFIGS = {
    "jamba": _jamba_config, "bamba": _bamba_config, "nemotron_h": _nemotron_h_config, "falcon_h1": _falcon_h1_config,
    "zamba2": _zamba2_config,
}


def ssm_tiny_config(model_type: str, *, vocab_size: int = 256, num_hidden_layers: int = 4, **overrides: Any):
    """A small config of a family in `SSM_TINY_TYPES`, fp32."""
    if model_type not in _CONFIGS:
        raise ValueError(f"unknown Mamba-family tiny type {model_type!r}; choose one of {SSM_TINY_TYPES}")
    return _CONFIGS[model_type](vocab_size, num_hidden_layers, overrides)


@torch.no_grad()
def adjust_ssm_model(model: torch.nn.Module, generator: torch.Generator, *, slow_decay: bool) -> None:
    """Slow decays for the Mamba layers beyond what `hypic_rag.testing.build_tiny_model`'s own loop does (it draws
    the SSD heads' A log-uniform in [0.005, 0.5]):
    - Mamba1's A [D, N] (jamba keeps dt in `dt_proj.bias`, not `dt_bias`) drawn the same way (transformers
      initialises it to 1..N per channel: every state forgets within a few tokens);
    - the SSD time step's bias set to 1 (dt about softplus(1) = 1.3, as Bamba, Granite and Falcon-H1 initialise
      it), where Nemotron-H and Zamba2 draw dt in [0.001, 0.1]: with A <= 0.5 a chunk's transition would then be
      ~1 and `transition` could not be told from `addition`."""
    if not slow_decay:
        return
    low, high = math.log(0.005), math.log(0.5)
    for module in model.modules():
        if hasattr(module, "A_log") and hasattr(module, "dt_proj") and not hasattr(module, "dt_bias"):
            module.A_log.copy_(torch.rand(module.A_log.shape, generator=generator) * (high - low) + low)
        elif hasattr(module, "A_log") and hasattr(module, "dt_bias"):
            module.dt_bias.fill_(1.0)


# ------------------------------------------------------------------------------------- published-layout stand-ins

PUBLISHED_SSM_KINDS = ("jamba", "bamba", "nemotron_h", "falcon_h1", "zamba2")
"""Families of `save_published_ssm_checkpoint`."""


def _published_jamba(vocab_size: int) -> dict[str, Any]:
    """ai21labs/Jamba-v0.1's config.json (keys and quirks as published from memory of the hub file: the remote-code
    `auto_map` of the first release, `n_ctx`, `num_logits_to_keep`, `use_mamba_kernels`, an explicit
    `mamba_dt_rank`), sizes shrunk: 8 layers with attention at 4 of every 8, MoE on odd layers."""
    return {
        "architectures": ["JambaForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_jamba.JambaConfig",
                     "AutoModelForCausalLM": "modeling_jamba.JambaForCausalLM"},
        "model_type": "jamba",
        "attention_dropout": 0.0, "attn_layer_offset": 4, "attn_layer_period": 8, "bos_token_id": 1,
        "eos_token_id": 2, "expert_layer_offset": 1, "expert_layer_period": 2, "hidden_act": "silu",
        "hidden_size": 64, "initializer_range": 0.2, "intermediate_size": 96, "mamba_conv_bias": True,
        "mamba_d_conv": 4, "mamba_d_state": 8, "mamba_dt_rank": 4, "mamba_expand": 2, "mamba_proj_bias": False,
        "max_position_embeddings": 262144, "n_ctx": 262144, "num_attention_heads": 4, "num_experts": 4,
        "num_experts_per_tok": 2, "num_hidden_layers": 8, "num_key_value_heads": 2, "num_logits_to_keep": 1,
        "output_router_logits": False, "pad_token_id": 0, "rms_norm_eps": 1e-06, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.40.0.dev0", "use_cache": True, "use_mamba_kernels": True,
        "vocab_size": vocab_size,
    }


def _jamba_tensor_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's names -> Jamba's published ones: the fused experts `feed_forward.experts.gate_up_proj`
    [E, 2F, h] / `down_proj` [E, h, F] split into `feed_forward.experts.{e}.gate_proj|up_proj|down_proj.weight`
    (transformers fuses them back on load, `conversion_mapping.py`)."""
    published: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith("feed_forward.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            for expert, fused in enumerate(tensor):
                gate, up = fused.chunk(2, dim=0)
                published[f"{base}{expert}.gate_proj.weight"] = gate
                published[f"{base}{expert}.up_proj.weight"] = up
        elif name.endswith("feed_forward.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for expert, weight in enumerate(tensor):
                published[f"{base}{expert}.down_proj.weight"] = weight
        else:
            published[name] = tensor
    return published


def _published_bamba(vocab_size: int) -> dict[str, Any]:
    """ibm-ai-platform/Bamba-9B's config.json (keys as published, from memory of the hub file: top-level
    `rope_theta` and `attn_rotary_emb` (the rotated dims, half a head), `mamba_d_head`, `num_logits_to_keep`,
    `use_mamba_kernels`), sizes shrunk: 8 layers with attention at 3 and 6."""
    return {
        "architectures": ["BambaForCausalLM"], "model_type": "bamba",
        "attention_bias": False, "attention_dropout": 0.0, "attn_layer_indices": [3, 6], "attn_rotary_emb": 8,
        "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.2,
        "intermediate_size": 96, "mamba_chunk_size": 16, "mamba_conv_bias": True, "mamba_d_conv": 4,
        "mamba_d_head": 32, "mamba_d_state": 16, "mamba_expand": 2, "mamba_n_groups": 1, "mamba_n_heads": 4,
        "mamba_proj_bias": False, "max_position_embeddings": 262144, "num_attention_heads": 4,
        "num_hidden_layers": 8, "num_key_value_heads": 2, "num_logits_to_keep": 1, "pad_token_id": 0,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.48.0.dev0", "use_cache": True, "use_mamba_kernels": True, "vocab_size": vocab_size,
    }


def _same_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoints published under transformers' own names (the port was written by the model's authors)."""
    return dict(tensors)


def _published_nemotron_h(vocab_size: int) -> dict[str, Any]:
    """nvidia/Nemotron-H-8B-Base-8K's config.json (keys as published, from memory of the hub file: the remote-code
    `auto_map`, `hybrid_override_pattern` ("M" Mamba2, "-" MLP, "*" attention), the `mamba_*` / `time_step_*`
    names, `attention_head_dim`, `rescale_prenorm_residual`, `residual_in_fp32`), sizes shrunk: 8 layers
    M-M*-M-M, Mamba2 with 4 heads of 32, 2 groups (the 8B has 8), N 16. transformers 5.24 reads no
    `attention_head_dim` (its `head_dim` defaults to 128, the 8B's value), so the stand-in keeps heads of 128."""
    return {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "auto_map": {"AutoConfig": "configuration_nemotron_h.NemotronHConfig",
                     "AutoModelForCausalLM": "modeling_nemotron_h.NemotronHForCausalLM"},
        "attention_bias": False, "attention_dropout": 0.0, "attention_head_dim": 128, "bos_token_id": 1,
        "chunk_size": 16, "conv_kernel": 4, "eos_token_id": 2, "expand": 2, "hidden_dropout": 0.0,
        "hidden_size": 64, "hybrid_override_pattern": "M-M*-M-M", "initializer_range": 0.2,
        "intermediate_size": 96, "layer_norm_epsilon": 1e-05, "mamba_head_dim": 32, "mamba_hidden_act": "silu",
        "mamba_num_heads": 4, "mamba_proj_bias": False, "max_position_embeddings": 8192, "mlp_bias": False,
        "mlp_hidden_act": "relu2", "n_groups": 2, "num_attention_heads": 4, "num_hidden_layers": 8,
        "num_key_value_heads": 2, "num_logits_to_keep": 1, "pad_token_id": 0, "rescale_prenorm_residual": True,
        "residual_in_fp32": False, "rms_norm_eps": 1e-05, "sliding_window": None, "ssm_state_size": 16,
        "tie_word_embeddings": False, "time_step_floor": 0.0001, "time_step_limit": [0.0, float("inf")],
        "time_step_max": 0.1, "time_step_min": 0.001, "time_step_rank": 256, "torch_dtype": "bfloat16",
        "transformers_version": "4.48.0.dev0", "use_bias": False, "use_cache": True, "use_conv_bias": True,
        "use_mamba_kernels": True, "vocab_size": vocab_size,
    }


def _nemotron_h_tensor_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's names -> Nemotron-H's published ones: the decoder under `backbone.` instead of `model.`
    (`backbone.embeddings`, `backbone.layers.{i}.norm|mixer.*`, `backbone.norm_f`); `lm_head` as is."""
    return {("backbone." + name.removeprefix("model.")) if name.startswith("model.") else name: tensor
            for name, tensor in tensors.items()}


def _published_falcon_h1(vocab_size: int) -> dict[str, Any]:
    """tiiuae/Falcon-H1-1.5B-Instruct's config.json (keys as published, from memory of the hub file: top-level
    `rope_theta` 1e11 and `rope_scaling`, `attn_layer_indices` null, `mamba_d_ssm`, `mamba_use_mlp`,
    `mlp_expansion_factor`, muP multipliers with the published values), sizes shrunk: 4 layers."""
    return {
        "architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1",
        "attention_bias": False, "attention_dropout": 0.0, "attention_in_multiplier": 1.0,
        "attention_out_multiplier": 0.9375, "attn_layer_indices": None, "bos_token_id": 1,
        "embedding_multiplier": 5.656854249492381, "eos_token_id": 11, "head_dim": 16, "hidden_act": "silu",
        "hidden_size": 64, "initializer_range": 0.2, "intermediate_size": 96, "key_multiplier": 0.390625,
        "lm_head_multiplier": 0.0390625, "mamba_chunk_size": 16, "mamba_conv_bias": True, "mamba_d_conv": 4,
        "mamba_d_head": 24, "mamba_d_ssm": 96, "mamba_d_state": 16, "mamba_expand": 2, "mamba_n_groups": 1,
        "mamba_n_heads": 4, "mamba_norm_before_gate": False, "mamba_proj_bias": False, "mamba_rms_norm": True,
        "mamba_use_mlp": True, "max_position_embeddings": 131072, "mlp_bias": False, "mlp_expansion_factor": 8,
        "mlp_multipliers": [0.8838834764831844, 0.5859375], "num_attention_heads": 4, "num_hidden_layers": 4,
        "num_key_value_heads": 2, "num_logits_to_keep": 1, "pad_token_id": 0, "projectors_bias": False,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 100000000000.0, "ssm_in_multiplier": 1.25,
        "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
        "ssm_out_multiplier": 0.23570226039551587, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.52.0.dev0", "use_cache": True, "vocab_size": vocab_size,
    }


def _published_zamba2(vocab_size: int) -> dict[str, Any]:
    """Zyphra/Zamba2-2.7B's config.json (keys as published, from memory of the hub file: legacy "mamba" / "hybrid"
    `layers_block_type`, `hybrid_layer_ids`, `ffn_hidden_size`, `kv_channels`, `num_query_groups`, `mamba_headdim`,
    top-level `rope_theta`, no `tie_word_embeddings` key: tied by default), sizes shrunk: 6 layers, hybrid at 1, 3, 5
    over 2 shared blocks (`num_mem_blocks`; layer 5 reuses layer 1's), no attention adapters (as the 2.7B)."""
    return {
        "architectures": ["Zamba2ForCausalLM"], "model_type": "zamba2",
        "adapter_rank": 8, "add_bias_linear": False, "attention_dropout": 0.0, "bos_token_id": 1, "chunk_size": 16,
        "eos_token_id": 2, "ffn_hidden_size": 96, "hidden_act": "gelu", "hidden_size": 64,
        "hybrid_layer_ids": [1, 3, 5], "initializer_range": 0.1, "intermediate_size": 96, "kv_channels": 16,
        "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid", "mamba", "hybrid"], "mamba_d_conv": 4,
        "mamba_d_state": 16, "mamba_expand": 2, "mamba_headdim": 32, "mamba_ngroups": 1,
        "max_position_embeddings": 4096, "n_mamba_heads": 4, "num_attention_heads": 4, "num_hidden_layers": 6,
        "num_key_value_heads": 4, "num_logits_to_keep": 1, "num_mem_blocks": 2, "num_query_groups": 4,
        "pad_token_id": 0, "rms_norm_eps": 1e-05, "rope_theta": 10000, "time_step_floor": 0.0001,
        "time_step_limit": None, "time_step_max": 0.1, "time_step_min": 0.001, "transformers_version": "4.48.0.dev0",
        "use_cache": True, "use_conv_bias": True, "use_long_context": False, "use_mem_eff_path": False,
        "use_mem_rope": False, "use_shared_attention_adapter": False, "vocab_size": vocab_size,
    }


def _without_tied_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tied weights stored once, under their first name (as `save_pretrained` writes them): Zamba2's shared blocks
    under the first hybrid layer of each memory block, the embeddings without a separate `lm_head.weight`."""
    kept: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        if tensor.untyped_storage().data_ptr() not in seen:
            seen.add(tensor.untyped_storage().data_ptr())
            kept[name] = tensor
    return kept


_PUBLISHED = {
    "jamba": (_published_jamba, _jamba_tensor_names),
    "zamba2": (_published_zamba2, _without_tied_copies),
    "falcon_h1": (_published_falcon_h1, _same_names),
    "bamba": (_published_bamba, _same_names),
    "nemotron_h": (_published_nemotron_h, _nemotron_h_tensor_names),
}


def published_ssm_config(kind: str, *, vocab_size: int = 512) -> dict[str, Any]:
    """The config.json of a hub checkpoint of `kind` (one of `PUBLISHED_SSM_KINDS`), keys as published, sizes shrunk."""
    if kind not in _PUBLISHED:
        raise ValueError(f"unknown published kind {kind!r}; choose one of {PUBLISHED_SSM_KINDS}")
    return _PUBLISHED[kind][0](vocab_size)


@torch.no_grad()
def save_published_ssm_checkpoint(
    path: str | Path, tokenizer: Any, *, kind: str = "jamba", seed: int = 0, shards: int = 2,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[Path, Any]:
    """Write a shrunken stand-in of a hub checkpoint of `kind` in its published layout; returns the directory and the
    fp32 causal LM whose weights (rounded to `dtype`) it holds.

    Layout: config.json as `published_ssm_config`; weights in `dtype` under their published names (see each
    family's renaming), split over `shards` `model-0000i-of-0000n.safetensors` files with a
    `model.safetensors.index.json`; `tokenizer` (a transformers tokenizer, e.g. the byte-level BPE of
    `hypic_rag.testing.train_tiny_tokenizer`) saved beside them, its size the vocabulary's.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from hypic_rag.testing.shards import write_sharded_safetensors

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = published_ssm_config(kind, vocab_size=len(tokenizer))
    config["eos_token_id"] = tokenizer.eos_token_id
    config["pad_token_id"] = tokenizer.pad_token_id
    torch.manual_seed(seed)
    settings = {key: value for key, value in config.items() if key not in ("auto_map", "architectures")}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**settings), dtype=torch.float32).eval()
    adjust_ssm_model(model, torch.Generator().manual_seed(seed + 1), slow_decay=True)
    for tensor in model.state_dict().values():
        if tensor.is_floating_point():
            tensor.copy_(tensor.to(dtype))
    renamed = _PUBLISHED[kind][1](model.state_dict())
    tensors = {name: tensor.to(dtype).contiguous() for name, tensor in renamed.items()}
    write_sharded_safetensors(path, tensors, shards)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(path)
    return path, model
