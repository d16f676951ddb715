"""Shrunken stand-ins of published checkpoints in their hub layouts (Qwen3.5 dense and MoE, the linear families,
LFM2), for the loader and end-to-end tests."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from hypic_rag.testing.shards import write_sharded_safetensors
from hypic_rag.testing.tiny import LINEAR_FAMILY_TINY_TYPES, tiny_layer_types, train_tiny_tokenizer


PUBLISHED_KINDS = ("qwen3_5", "qwen3_5_moe")
"""Families of `save_published_checkpoint`: the dense Qwen3.5 and the Qwen3.5-MoE hub checkpoints."""


def published_config(kind: str = "qwen3_5", *, vocab_size: int = 512) -> dict[str, Any]:
    """The config.json of a Qwen3.5 hub checkpoint of `kind`, with its keys as published and its sizes shrunk.

    Published quirks kept: the architecture is `...ForConditionalGeneration`, the text model sits in
    `text_config` (with its multi-token-prediction keys and multimodal RoPE sections), and `vision_config` carries
    the outer model type (`qwen3_5` / `qwen3_5_moe`), which transformers rewrites on load.
    """
    if kind not in PUBLISHED_KINDS:
        raise ValueError(f"unknown published kind {kind!r}; choose one of {PUBLISHED_KINDS}")
    moe = kind == "qwen3_5_moe"
    text: dict[str, Any] = {
        "model_type": f"{kind}_text",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "full_attention_interval": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "attn_output_gate": True,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
        },
        "dtype": "bfloat16",
        "eos_token_id": 0,
    }
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                    shared_expert_intermediate_size=48, router_aux_loss_coef=0.001, output_router_logits=False)
    else:
        text.update(intermediate_size=96)
    vision = {
        "model_type": kind,  # as published (transformers maps it to the vision model type)
        "depth": 1,
        "hidden_size": 32,
        "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": 64,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 64,
        "num_position_embeddings": 16,
        "initializer_range": 0.02,
        "deepstack_visual_indexes": [],
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": kind,
        "text_config": text,
        "vision_config": vision,
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "tie_word_embeddings": False,
        "transformers_version": "4.57.0.dev0",
    }


@torch.no_grad()
def build_published_model(config: dict[str, Any], *, seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    """A seeded `Qwen3_5(Moe)ForConditionalGeneration` of `config` (a `published_config`), eval mode, fp32, whose
    weights are rounded to `dtype` (so it equals what its checkpoint saved in `dtype` loads in fp32)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.manual_seed(seed)
    hf_config = AutoConfig.for_model(**json.loads(json.dumps(config)))
    model = AutoModelForImageTextToText.from_config(hf_config, dtype=torch.float32)
    for tensor in model.state_dict().values():
        if tensor.is_floating_point():
            tensor.copy_(tensor.to(dtype))
    return model.eval()


def _mtp_tensors(model: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Stand-in multi-token-prediction weights under the published `mtp.*` names: the fusion projection, its norms
    and one decoder layer shaped like the model's attention layer (transformers ignores them on load)."""
    text = model.config.text_config
    hidden = text.hidden_size
    generator = torch.Generator().manual_seed(7)
    tensors = {
        "mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=generator),
        "mtp.pre_fc_norm_embedding.weight": torch.zeros(hidden),
        "mtp.pre_fc_norm_hidden.weight": torch.zeros(hidden),
        "mtp.norm.weight": torch.zeros(hidden),
    }
    attention_layer = text.layer_types.index("full_attention")
    prefix = f"model.language_model.layers.{attention_layer}."
    for name, tensor in model.state_dict().items():
        if name.startswith(prefix):
            tensors["mtp.layers.0." + name[len(prefix):]] = torch.randn(tensor.shape, generator=generator)
    return {name: tensor.to(dtype).contiguous() for name, tensor in tensors.items()}


def save_published_checkpoint(
    path: str | Path, texts: Iterable[str], *, kind: str = "qwen3_5", seed: int = 0, shards: int = 2,
    dtype: torch.dtype = torch.bfloat16, tokenizer_vocab_size: int = 512,
) -> tuple[Path, Any]:
    """Write a shrunken stand-in of a Qwen3.5 hub checkpoint of `kind` in its published layout; returns the
    directory and the `...ForConditionalGeneration` instance whose weights it holds (rounded to `dtype`).

    Layout: config.json as `published_config`; weights in `dtype` under their published names
    (`model.language_model.*`, `model.visual.*`, `lm_head.weight`, `mtp.*`; the MoE experts fused per layer as
    `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]) split over `shards`
    `model-0000i-of-0000n.safetensors` files with a `model.safetensors.index.json`; a byte-level BPE tokenizer.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tiny_tokenizer(texts, vocab_size=tokenizer_vocab_size)
    config = published_config(kind, vocab_size=len(tokenizer))
    config["text_config"]["eos_token_id"] = tokenizer.eos_token_id
    model = build_published_model(config, seed=seed, dtype=dtype)
    tensors = {name: tensor.to(dtype).contiguous() for name, tensor in model.state_dict().items()}
    tensors.update(_mtp_tensors(model, dtype))
    write_sharded_safetensors(path, tensors, shards)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(path)
    return path, model




# ------------------------------------------------------------------------- published layouts of the linear families


def linear_family_published_config(model_type: str, *, vocab_size: int = 512, eos_token_id: int = 0) -> dict[str, Any]:
    """config.json of a `LINEAR_FAMILY_TINY_TYPES` checkpoint with its keys as published and its sizes shrunk (the
    sizes of `linear_family_config`). Key names follow transformers 5.24's config attribute maps, which mirror the
    hub files: Kimi's `linear_attn_config` (1-indexed layer lists), `num_experts`, `num_experts_per_token`,
    `num_shared_experts`, `num_expert_group`, `moe_renormalize`, `model_max_length` and its remote-code `auto_map`;
    Ling's `head_dim` (the KDA head dim), `num_nextn_predict_layers` and a bare `rope_theta`; OLMo-Hybrid's
    `rope_theta` of null (NoPE); MiniMax's per-layer-type residual factors. Not checked against the hub files."""
    layers = 4
    common: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": 64, "num_hidden_layers": layers, "intermediate_size": 96,
        "num_attention_heads": 4, "hidden_act": "silu", "initializer_range": 0.02, "tie_word_embeddings": False,
        "use_cache": True, "torch_dtype": "bfloat16", "eos_token_id": eos_token_id, "bos_token_id": eos_token_id,
        "pad_token_id": eos_token_id, "transformers_version": "4.57.1",
    }
    mla = {"kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
           "num_key_value_heads": 4, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_token": 2,
           "num_shared_experts": 1, "moe_renormalize": True, "routed_scaling_factor": 2.446, "first_k_dense_replace": 1,
           "attention_bias": False, "model_max_length": 4096, "rms_norm_eps": 1e-5}
    if model_type == "kimi_linear":
        return {
            "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
            "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig",
                         "AutoModel": "modeling_kimi.KimiLinearModel",
                         "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"},
            **common, **mla, "num_expert_group": 1, "topk_group": 1, "use_grouped_topk": True,
            "moe_router_activation_func": "sigmoid", "mla_use_nope": True, "rope_theta": 10000.0,
            "linear_attn_config": {"full_attn_layers": [4], "kda_layers": [1, 2, 3], "head_dim": 16, "num_heads": 4,
                                   "short_conv_kernel_size": 4},
        }
    if model_type == "bailing_hybrid":
        return {
            "architectures": ["BailingHybridForCausalLM"], "model_type": "bailing_hybrid", **common, **mla,
            "head_dim": 16, "short_conv_kernel_size": 4, "layer_group_size": 4, "num_expert_group": 2,
            "topk_group": 1, "num_nextn_predict_layers": 0, "kda_safe_gate": True, "kda_lower_bound": -5.0,
            "rope_theta": 10000.0,
        }
    if model_type == "olmo_hybrid":
        return {
            "architectures": ["OlmoHybridForCausalLM"], "model_type": "olmo_hybrid", **common,
            "num_key_value_heads": 4, "layer_types": tiny_layer_types(layers), "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4, "linear_allow_neg_eigval": True, "rope_theta": None, "rope_scaling": None,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "attention_bias": False,
        }
    if model_type == "minimax":
        return {
            "architectures": ["MiniMaxForCausalLM"], "model_type": "minimax", **common,
            "num_key_value_heads": 2, "head_dim": 16, "layer_types": tiny_layer_types(layers),
            "num_local_experts": 4, "num_experts_per_tok": 2, "block_size": 16, "rope_theta": 10000.0,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "sliding_window": None,
            "linear_attn_alpha_factor": 1.4, "linear_attn_beta_factor": 0.9, "full_attn_alpha_factor": 1.3,
            "full_attn_beta_factor": 1.1, "mlp_alpha_factor": 1.2, "mlp_beta_factor": 0.8,
        }
    raise ValueError(f"unknown linear family {model_type!r}; choose one of {LINEAR_FAMILY_TINY_TYPES}")


def _unfused_experts(
    name: str, tensor: torch.Tensor, prefix: str, gate: str, up: str, down: str
) -> dict[str, torch.Tensor]:
    """Fused expert weights (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) as published: one
    tensor per expert and projection, `{prefix}experts.{e}.{gate|up|down}.weight`."""
    if name.endswith("experts.gate_up_proj"):
        half = tensor.shape[1] // 2
        out = {f"{prefix}experts.{e}.{gate}.weight": tensor[e, :half] for e in range(tensor.shape[0])}
        out.update({f"{prefix}experts.{e}.{up}.weight": tensor[e, half:] for e in range(tensor.shape[0])})
        return out
    return {f"{prefix}experts.{e}.{down}.weight": tensor[e] for e in range(tensor.shape[0])}


MINIMAX_DECAY_BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")
"""MiniMax lightning layers' decay buffers: functions of the config, which transformers computes at load."""


def linear_family_published_tensors(model_type: str, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers state dict of a `LINEAR_FAMILY_TINY_TYPES` model under its published names (what transformers'
    conversion mapping renames on load): the q / k / v convs as three `q_conv1d` / `k_conv1d` / `v_conv1d` tensors;
    per-expert MoE weights (Kimi, MiniMax: `block_sparse_moe.experts.{e}.w1/w2/w3`; Ling: `mlp.experts.{e}.
    gate_proj/up_proj/down_proj`); Kimi / Ling's forget-gate weights on the attention module; Ling's
    `word_embeddings`, `attention.*`, `attention.dense` and `gate.expert_bias`; OLMo's linear layers'
    `attention_layer_norm` / `feedforward_layer_norm`. MiniMax's lightning decay buffers are left out (transformers
    recomputes them at load, exactly; stored in bfloat16 its block tables would round the decays)."""
    published: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if model_type == "minimax" and name.endswith(MINIMAX_DECAY_BUFFERS):
            continue
        name = name.replace(".forget_gate.", ".")
        moe = any(part in name for part in (".mlp.experts.", ".mlp.gate.", ".mlp.shared_experts."))
        if model_type in ("kimi_linear", "minimax") and moe:  # a dense layer's `mlp.gate_proj` keeps its name
            name = name.replace(".mlp.", ".block_sparse_moe.")
            if ".block_sparse_moe.experts." in name:
                prefix = name[: name.index("experts.")]
                published.update(_unfused_experts(name, tensor, prefix, "w1", "w3", "w2"))
                continue
        if model_type == "bailing_hybrid":
            if ".mlp.experts." in name:
                prefix = name[: name.index("experts.")]
                published.update(_unfused_experts(name, tensor, prefix, "gate_proj", "up_proj", "down_proj"))
                continue
            name = (name.replace("model.embed_tokens.", "model.word_embeddings.").replace(".self_attn.", ".attention.")
                    .replace(".attention.o_proj.", ".attention.dense.")
                    .replace(".gate.e_score_correction_bias", ".gate.expert_bias"))
        if model_type == "olmo_hybrid" and ".input_layernorm." in name:  # only the linear layers have one
            layer = name[: name.index(".input_layernorm.")]
            published[f"{layer}.attention_layer_norm.weight"] = tensor
            published[f"{layer}.feedforward_layer_norm.weight"] = state[f"{layer}.post_attention_layernorm.weight"]
            continue
        if model_type == "olmo_hybrid" and ".post_attention_layernorm." in name:
            layer = name[: name.index(".post_attention_layernorm.")]
            if f"{layer}.input_layernorm.weight" in state:
                continue  # written with its input norm above
        if name.endswith("conv1d.weight"):
            stem = name[: -len("conv1d.weight")]
            for part, piece in zip("qkv", tensor.chunk(3, dim=0)):
                published[f"{stem}{part}_conv1d.weight"] = piece
            continue
        published[name] = tensor
    return published


def save_linear_family_checkpoint(
    path: str | Path, texts: Iterable[str], *, model_type: str, seed: int = 0, shards: int = 2,
    dtype: torch.dtype = torch.bfloat16, tokenizer_vocab_size: int = 512,
) -> tuple[Path, Any]:
    """Write a shrunken stand-in of a `model_type` hub checkpoint (a `LINEAR_FAMILY_TINY_TYPES` family) in its
    published layout: config.json as `linear_family_published_config`, weights in `dtype` under the names of
    `linear_family_published_tensors` over `shards` safetensors files with an index, a byte-level BPE tokenizer.
    Returns the directory and the `...ForCausalLM` instance whose weights it holds (rounded to `dtype`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tiny_tokenizer(texts, vocab_size=tokenizer_vocab_size)
    config = linear_family_published_config(model_type, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    settings = {key: value for key, value in config.items() if key not in ("model_type", "auto_map")}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **settings), dtype=torch.float32)
    with torch.no_grad():  # what the checkpoint holds, rounded to its dtype (not the buffers it leaves out)
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point() and not name.endswith(MINIMAX_DECAY_BUFFERS):
                tensor.copy_(tensor.to(dtype))
    tensors = linear_family_published_tensors(model_type, model.state_dict())
    write_sharded_safetensors(path, {name: t.to(dtype).contiguous() for name, t in tensors.items()}, shards)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(path)
    return path, model.eval()



# ------------------------------------------------------------------------------------ published layout of LFM2

LFM2_LAYER_FORMS = ("layer_types", "full_attn_idxs")
"""How an LFM2 config.json names its attention layers: `layer_types` beside `full_attn_idxs` (the hub files as
revised for transformers' port) or `full_attn_idxs` alone (the first release)."""


def lfm2_published_config(*, vocab_size: int = 512, eos_token_id: int = 7, layer_form: str = "layer_types") -> dict[str, Any]:
    """LiquidAI/LFM2-1.2B's config.json with its keys as published (from memory of the hub file, not checked against
    it: the original trainer's `block_*` / `conv_*` names beside transformers' own, `tie_embedding`, `num_heads`,
    `theta` beside `rope_theta`, `block_ff_dim` with `block_auto_adjust_ff_dim`), sizes shrunk: 6 layers with
    attention at 2 and 5 (the 1.2B: 16 layers, attention at 2, 5, 8, 10, 12, 14), hidden 64, 4 heads of 16, 2 KV
    heads, `block_ff_dim` 200 (auto-adjusted to 160: int(2 * 200 / 3) rounded up to `block_multiple_of` 32)."""
    if layer_form not in LFM2_LAYER_FORMS:
        raise ValueError(f"unknown layer form {layer_form!r}; choose one of {LFM2_LAYER_FORMS}")
    layers, attention = 6, [2, 5]
    config: dict[str, Any] = {
        "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2",
        "block_auto_adjust_ff_dim": True, "block_dim": 64, "block_ff_dim": 200, "block_ffn_dim_multiplier": 1.0,
        "block_mlp_init_scale": 1.0, "block_multiple_of": 32, "block_norm_eps": 1e-05, "block_out_init_scale": 1.0,
        "block_use_swiglu": True, "block_use_xavier_init": True, "bos_token_id": 1, "conv_L_cache": 3,
        "conv_bias": False, "conv_dim": 64, "conv_dim_out": 64, "conv_use_xavier_init": True,
        "eos_token_id": eos_token_id, "full_attn_idxs": attention, "hidden_size": 64, "initializer_range": 0.02,
        "intermediate_size": 200, "max_position_embeddings": 128000, "norm_eps": 1e-05, "num_attention_heads": 4,
        "num_heads": 4, "num_hidden_layers": layers, "num_key_value_heads": 2, "pad_token_id": 0,
        "rope_theta": 1000000.0, "theta": 1000000.0, "tie_embedding": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.54.0.dev0", "use_cache": True, "use_pos_enc": True, "vocab_size": vocab_size,
    }
    if layer_form == "layer_types":
        config["layer_types"] = ["full_attention" if i in attention else "conv" for i in range(layers)]
    return config


@torch.no_grad()
def save_lfm2_checkpoint(
    path: str | Path, texts: Iterable[str], *, layer_form: str = "layer_types", seed: int = 0,
    dtype: torch.dtype = torch.bfloat16, tokenizer_vocab_size: int = 512,
) -> tuple[Path, Any]:
    """Write a shrunken stand-in of LiquidAI/LFM2-1.2B in its published layout: config.json as
    `lfm2_published_config`, ONE `model.safetensors` in `dtype` under transformers' own module names (LFM2's port
    has no conversion mapping: `model.layers.{i}.conv.{in_proj, conv, out_proj}`, `self_attn.{q,k}_layernorm`,
    `self_attn.out_proj`, `feed_forward.w1/w2/w3`, `operator_norm`, `ffn_norm`, `model.embedding_norm`) and no
    `lm_head.weight` (tied to the embeddings), a byte-level BPE tokenizer. The weights are drawn at the tiny models'
    scale (0.2, every norm gain 1 +- 0.2, so a tensor the loader missed shows) whatever `initializer_range` says.
    Returns the directory and the `Lfm2ForCausalLM` instance whose weights it holds (rounded to `dtype`)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tiny_tokenizer(texts, vocab_size=tokenizer_vocab_size)
    config = lfm2_published_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                   layer_form=layer_form)
    config["pad_token_id"] = tokenizer.pad_token_id
    settings = {key: value for key, value in config.items() if key != "model_type"}
    settings["initializer_range"] = 0.2
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("lfm2", **settings), dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    state = model.state_dict()
    for name, tensor in state.items():
        if name.endswith("norm.weight"):
            tensor.copy_(1.0 + 0.2 * torch.randn(tensor.shape, generator=generator))
        tensor.copy_(tensor.to(dtype))
    tensors = {name: tensor.to(dtype).contiguous() for name, tensor in state.items() if name != "lm_head.weight"}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(path)
    return path, model
