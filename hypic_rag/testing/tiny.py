"""Test kits, for tests and benchmarks: this module (tiny random hybrid models and tokenizers, no network, seconds
to build; corpora and indexes), `ssm` (tiny Mamba-family hybrids and published-layout stand-ins), `s3` (a local
S3-compatible server), `mixer_checks` (the mixer interface's contract as executable checks).

Tiny random hybrid models and tokenizers:

`tiny_config` gives a small transformers config of a supported hybrid family; `build_tiny_model` instantiates it
with seeded random weights, optionally with slow linear-attention decays (so composition bugs cannot hide behind
fast forgetting) and sharpened q/k norms (so attention is not uniform and position errors show);
`save_tiny_checkpoint` writes a loadable local checkpoint directory with a trained byte-level BPE tokenizer;
`save_published_checkpoint` writes a shrunken stand-in of a Qwen3.5 hub checkpoint in its published layout
(multimodal config, `model.language_model.*` weights, a vision tower, `mtp.*` weights, fused MoE experts, sharded
safetensors with an index file); `save_linear_family_checkpoint` and `save_lfm2_checkpoint` do the same for the
linear families beyond Gated DeltaNet and for LiquidAI LFM2.

For tests and examples of the service and integrations, a small corpus, a tiny checkpoint and an index:

    model = tiny_model_checkpoint(tmp / "model")              # tiny random qwen3_5 + trained BPE (seconds)
    index = build_index(tmp / "index", model, SMALL_CORPUS)   # chunk, embed, index, encode every chunk

With the tiny random model answers are gibberish; retrieval (the shipped MiniLM embedder), streaming, token
accounting and cache behaviour are real. Answer correctness needs the bundled default model.
"""

from __future__ import annotations

import json
import math
import socket
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from hypic_rag.testing.shards import write_sharded_safetensors
from hypic_rag.testing.ssm import SSM_TINY_TYPES, adjust_ssm_model, ssm_tiny_config

LINEAR_FAMILY_TINY_TYPES = ("kimi_linear", "bailing_hybrid", "olmo_hybrid", "minimax")
"""Families beyond Gated DeltaNet whose tiny configs `linear_family_config` writes (docs/families_linear.md)."""
SUPPORTED_TINY_TYPES = (
    "qwen3_5", "qwen3_5_moe", "qwen3_next", "granitemoehybrid", "lfm2", *LINEAR_FAMILY_TINY_TYPES, *SSM_TINY_TYPES
)


def _tiny_layer_types(count: int, linear: str = "linear_attention") -> list[str]:
    """Per layer: attention at every fourth layer (i % 4 == 3), or the middle layer of a shorter stack."""
    kinds = [linear] * count
    for index in range(3, count, 4):
        kinds[index] = "full_attention"
    if count > 1 and "full_attention" not in kinds:
        kinds[count // 2] = "full_attention"
    return kinds


def linear_family_config(model_type: str, *, vocab_size: int = 256, num_hidden_layers: int = 4, **overrides: Any):
    """A small config of a family in `LINEAR_FAMILY_TINY_TYPES` (hidden 64, 4 heads; attention at i % 4 == 3).

    kimi_linear / bailing_hybrid: KDA with 4 heads of 16, conv 4; MLA with 4 heads, latent 16, nope 16, rope 8,
    value 16; a dense MLP in layer 0, then MoE (4 experts, top 2, one shared expert).
    olmo_hybrid: Gated DeltaNet with 2 key heads and 4 value heads of 16, conv 4; NoPE attention (4 heads of 16, 2
    KV heads) unless `rope_parameters` sets a theta.
    minimax: lightning attention with 4 heads of 16 (computed by transformers in blocks of 16), softmax attention
    with 2 KV heads and RoPE, residual factors (alpha, beta) that differ per layer type, MoE (4 experts, top 2).
    """
    layer_types = _tiny_layer_types(num_hidden_layers)
    settings: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": 64, "num_hidden_layers": num_hidden_layers, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 4, "layer_types": layer_types,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "pad_token_id": None, "bos_token_id": None,
        "eos_token_id": None,
    }
    if model_type in ("kimi_linear", "bailing_hybrid"):
        settings.update(
            moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            first_k_dense_replace=1,
        )
    if model_type == "kimi_linear":
        from transformers import KimiLinearConfig as config_class

        settings.update(linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4, n_group=1, topk_group=1)
    elif model_type == "bailing_hybrid":
        from transformers import BailingHybridConfig as config_class

        settings.update(head_dim=16, short_conv_kernel_size=4, n_group=2, topk_group=1, num_mtp_layers=0,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif model_type == "olmo_hybrid":
        from transformers import OlmoHybridConfig as config_class

        settings.update(num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                        rope_parameters={"rope_type": "default", "rope_theta": None})
    elif model_type == "minimax":
        from transformers import MiniMaxConfig as config_class

        settings.update(num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, block_size=16,
                        linear_attn_alpha_factor=1.4, linear_attn_beta_factor=0.9, full_attn_alpha_factor=1.3,
                        full_attn_beta_factor=1.1, mlp_alpha_factor=1.2, mlp_beta_factor=0.8,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    else:
        raise ValueError(f"unknown linear family {model_type!r}; choose one of {LINEAR_FAMILY_TINY_TYPES}")
    settings.update(overrides)
    return config_class(**settings)


@torch.no_grad()
def adjust_linear_family_model(
    model: Any, generator: torch.Generator, *, slow_decay: bool, attention_gain: float | None
) -> None:
    """What `build_tiny_model` does for the Qwen families, for a model of `LINEAR_FAMILY_TINY_TYPES`.

    slow_decay: Ling's bounded KDA gate g = -5 sigmoid(A (f(x) + dt_bias)) decays fast at its default init; with A = 1
    and dt_bias uniform in [-9, -3] its per-channel decays lie in (-0.25, -6e-4) (Kimi's softplus gate gets its slow
    A from `build_tiny_model`). attention_gain: MLA's latent norm gain (keys and values), OLMo's q / k norm gains set
    to about this value, so attention is peaked.
    """
    for module in model.modules():
        name = type(module).__name__
        if slow_decay and name == "BailingHybridForgetGate":
            module.A_log.zero_()
            module.dt_bias.copy_(torch.rand(module.dt_bias.shape, generator=generator) * 6.0 - 9.0)
        if attention_gain is not None and name == "OlmoHybridAttention":  # plain (not zero-centred) RMSNorm gains
            for norm in (module.q_norm, module.k_norm):
                norm.weight.copy_(attention_gain + 0.1 * torch.randn(norm.weight.shape, generator=generator))
        if attention_gain is not None and hasattr(module, "kv_a_layernorm"):
            weight = module.kv_a_layernorm.weight
            weight.copy_(attention_gain + 0.1 * torch.randn(weight.shape, generator=generator))


def _tiny_lfm2_config(vocab_size: int, num_hidden_layers: int, overrides: dict[str, Any]):
    """A small `lfm2` config: gated short-conv layers (kernel 3) and RoPE attention (the middle layer unless
    `layer_types` says otherwise), no special token ids (so greedy decoding never stops early)."""
    from transformers import Lfm2Config

    layer_types = ["conv"] * num_hidden_layers
    if num_hidden_layers > 1:
        layer_types[num_hidden_layers // 2] = "full_attention"
    settings: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=num_hidden_layers, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=96, block_auto_adjust_ff_dim=False, conv_L_cache=3,
        layer_types=layer_types, max_position_embeddings=4096, tie_word_embeddings=False, initializer_range=0.2,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )
    settings.update(overrides)
    return Lfm2Config(**settings)


def _tiny_granite_config(vocab_size: int, num_hidden_layers: int, overrides: dict[str, Any]):
    """A small `granitemoehybrid` config: Mamba2 layers (2 groups of B/C) and NoPE attention, MoE + shared MLP,
    multipliers like Granite 4.0-H's (embedding x12, logits / 2, residual x0.22, attention scale 1/16) and weights
    large enough (initializer_range 0.2) that the modes' deviations are far above float32 round-off."""
    from transformers import GraniteMoeHybridConfig

    layer_types = ["linear_attention"] * num_hidden_layers
    if num_hidden_layers > 1:
        layer_types[num_hidden_layers // 2] = "full_attention"
    settings: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=num_hidden_layers, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, shared_intermediate_size=48, num_local_experts=4,
        num_experts_per_tok=2, mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=16, layer_types=layer_types, embedding_multiplier=12.0, logits_scaling=2.0,
        residual_multiplier=0.22, attention_multiplier=0.0625, max_position_embeddings=4096,
        tie_word_embeddings=False, position_embedding_type="nope", initializer_range=0.2,
    )
    settings.update(overrides)
    return GraniteMoeHybridConfig(**settings)


def tiny_config(model_type: str = "qwen3_5", *, vocab_size: int = 256, num_hidden_layers: int = 4, **overrides: Any):
    """A small config of `model_type` (3 linear layers : 1 attention layer by default), fp32."""
    if model_type == "granitemoehybrid":
        return _tiny_granite_config(vocab_size, num_hidden_layers, overrides)
    if model_type == "lfm2":
        return _tiny_lfm2_config(vocab_size, num_hidden_layers, overrides)
    if model_type in LINEAR_FAMILY_TINY_TYPES:
        return linear_family_config(model_type, vocab_size=vocab_size, num_hidden_layers=num_hidden_layers, **overrides)
    if model_type in SSM_TINY_TYPES:
        return ssm_tiny_config(model_type, vocab_size=vocab_size, num_hidden_layers=num_hidden_layers, **overrides)
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        intermediate_size=96,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    if model_type == "qwen3_5":
        from transformers import Qwen3_5TextConfig as config_class
    elif model_type == "qwen3_5_moe":
        from transformers import Qwen3_5MoeTextConfig as config_class

        common.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=48)
    elif model_type == "qwen3_next":
        from transformers import Qwen3NextConfig as config_class

        common.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=48,
            decoder_sparse_step=1,
        )
    else:
        raise ValueError(f"unknown tiny model type {model_type!r}; choose one of {SUPPORTED_TINY_TYPES}")
    common.update(overrides)
    config = config_class(**common)
    return config


@torch.no_grad()
def build_tiny_model(
    model_type: str = "qwen3_5", *, seed: int = 0, slow_decay: bool = True, qk_norm_scale: float | None = 2.5,
    config: Any | None = None, **overrides: Any,
):
    """A seeded random transformers causal LM, eval mode, fp32.

    slow_decay: draw the linear layers' decay rate A log-uniform in [0.005, 0.5] instead of U(0.01, 16).
    qk_norm_scale: set the attention q/k norm gains to about this value so attention is peaked.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = config if config is not None else tiny_config(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    for module in model.modules():
        if slow_decay and hasattr(module, "A_log") and hasattr(module, "dt_bias"):
            low, high = math.log(0.005), math.log(0.5)
            log_a = torch.rand(module.A_log.shape, generator=generator) * (high - low) + low
            module.A_log.copy_(log_a)
        if qk_norm_scale is not None and hasattr(module, "q_norm") and hasattr(module, "k_norm"):
            for norm in (module.q_norm, module.k_norm):
                # zero-centred RMSNorm: the gain is (1 + weight)
                norm.weight.copy_(qk_norm_scale - 1.0 + 0.1 * torch.randn(norm.weight.shape, generator=generator))
        if qk_norm_scale is not None and hasattr(module, "q_layernorm") and hasattr(module, "k_layernorm"):
            for norm in (module.q_layernorm, module.k_layernorm):  # LFM2's per-head norms: plain gains
                norm.weight.copy_(qk_norm_scale + 0.1 * torch.randn(norm.weight.shape, generator=generator))
    if config.model_type in LINEAR_FAMILY_TINY_TYPES:
        adjust_linear_family_model(model, generator, slow_decay=slow_decay, attention_gain=qk_norm_scale)
    if model.config.model_type in SSM_TINY_TYPES:
        adjust_ssm_model(model, generator, slow_decay=slow_decay)
    return model.eval()


def train_tiny_tokenizer(texts: Iterable[str], vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on `texts`, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=special[1:],
    )


def save_tiny_checkpoint(
    path: str | Path, texts: Iterable[str], *, model_type: str = "qwen3_5", seed: int = 0,
    tokenizer_vocab_size: int = 512, **overrides: Any,
) -> Path:
    """Write a local checkpoint directory (config, safetensors weights, tokenizer) loadable by `load_model`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tiny_tokenizer(texts, vocab_size=tokenizer_vocab_size)
    model = build_tiny_model(model_type, seed=seed, vocab_size=len(tokenizer), **overrides)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


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
            "num_key_value_heads": 4, "layer_types": _tiny_layer_types(layers), "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4, "linear_allow_neg_eigval": True, "rope_theta": None, "rope_scaling": None,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "attention_bias": False,
        }
    if model_type == "minimax":
        return {
            "architectures": ["MiniMaxForCausalLM"], "model_type": "minimax", **common,
            "num_key_value_heads": 2, "head_dim": 16, "layer_types": _tiny_layer_types(layers),
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

SMALL_CORPUS: dict[str, str] = {
    "glassblowing.md": (
        "Alice Marlow is a glassblower who lives in Pellington. She founded the Amber Kiln studio in 1998 and "
        "teaches evening classes there."
    ),
    "astronomy.md": (
        "Bob Tanaka is an astronomer at the Ridgeview Observatory. He discovered the comet Tanaka-3 in 2011 "
        "with a small refracting telescope."
    ),
    "lavender.md": (
        "Carol Esposito grows lavender on a farm near the river Vell. Her farm also keeps bees and sells honey "
        "at the Saturday market."
    ),
    "bicycles.md": (
        "Dmitri Volkov repairs vintage bicycles in a workshop in Harrow Cove. He rebuilt his first racing frame "
        "when he was twelve."
    ),
    "volcano.md": (
        "Mount Keral is a dormant volcano on the island of Tessaly. Its last eruption, in 1821, covered the "
        "eastern villages in ash."
    ),
    "chess.md": (
        "The Westbrook Chess Club meets every Thursday in the old library. Its champion, Elena Ruiz, has won "
        "the regional tournament four times."
    ),
}
"""Six one-paragraph documents on unrelated topics; `SMALL_CORPUS_QUESTIONS` asks one question about each."""

SMALL_CORPUS_QUESTIONS: dict[str, str] = {
    "glassblowing.md": "Who founded the Amber Kiln glass studio?",
    "astronomy.md": "Which astronomer discovered a comet with a telescope?",
    "lavender.md": "Who grows lavender and sells honey?",
    "bicycles.md": "Who repairs old racing bicycles?",
    "volcano.md": "When did the volcano Mount Keral last erupt?",
    "chess.md": "Who is the champion of the chess club?",
}


def tiny_model_checkpoint(directory: Path, texts: list[str] | None = None) -> Path:
    """A tiny random qwen3_5 checkpoint whose tokenizer was trained on `texts` (default: the small corpus);
    reused when `directory` already holds one."""
    directory = Path(directory)
    if (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file():
        return directory
    corpus = texts if texts is not None else list(SMALL_CORPUS.values()) + list(SMALL_CORPUS_QUESTIONS.values())
    return save_tiny_checkpoint(directory, corpus * 4)


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A ChatML-style chat template (the layout of Qwen checkpoints' templates) for tiny test checkpoints."""


def templated_checkpoint(directory: Path, base: Path, template: str = TINY_CHAT_TEMPLATE) -> Path:
    """A copy of the checkpoint `base` whose tokenizer carries `template` as its chat template (reused when
    `directory` already holds one)."""
    import shutil

    from transformers import AutoTokenizer

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        shutil.copytree(base, directory)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        tokenizer.chat_template = template
        tokenizer.save_pretrained(directory)
    return directory


def write_corpus(directory: Path, documents: Mapping[str, str]) -> Path:
    """Write `documents` (file name -> text) into `directory`; returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in documents.items():
        (directory / name).write_text(text + "\n", encoding="utf-8")
    return directory


def build_index(
    directory: Path, model_path: Path, documents: Mapping[str, str] | Path, *, chunk_tokens: int = 96,
    seam_tokens: int = 8,
) -> Path:
    """Precompute an index of `documents` (a mapping written to `<directory>.corpus`, or a corpus path) on CPU,
    quietly (`hypic_rag.build_index`); returns `directory`."""
    from hypic_rag.pipeline.precompute import build_index as build

    directory = Path(directory)
    if isinstance(documents, Path):
        corpus = documents
    else:
        corpus = write_corpus(directory.with_name(directory.name + ".corpus"), documents)
    build(corpus, directory, model=model_path, chunk_tokens=chunk_tokens, seam_tokens=seam_tokens, device="cpu",
          show_progress=False)
    return directory


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for a server started in another process)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def random_request(
    source: int | torch.Generator, chunk_lengths: list[int], prefix: int = 5, question: int = 6, *,
    vocab: int = 256, lowest: int = 0,
) -> Any:
    """A `Request` of random token ids in [lowest, vocab): a prefix of `prefix` tokens, chunks of `chunk_lengths`,
    a question of `question`; `source` a seed or a generator (drawn from in that order)."""
    from hypic_rag.runtime.request import Request

    generator = source if isinstance(source, torch.Generator) else torch.Generator().manual_seed(source)

    def ids(count: int) -> list[int]:
        return torch.randint(lowest, vocab, (count,), generator=generator).tolist()

    return Request(ids(prefix), [ids(count) for count in chunk_lengths], ids(question))
