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

import math
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from hypic_rag.testing.ssm import SSM_TINY_TYPES, adjust_ssm_model, ssm_tiny_config

LINEAR_FAMILY_TINY_TYPES = ("kimi_linear", "bailing_hybrid", "olmo_hybrid", "minimax")
"""Families beyond Gated DeltaNet whose tiny configs `linear_family_config` writes (docs/families_linear.md)."""
SUPPORTED_TINY_TYPES = (
    "qwen3_5", "qwen3_5_moe", "qwen3_next", "granitemoehybrid", "lfm2", *LINEAR_FAMILY_TINY_TYPES, *SSM_TINY_TYPES
)


def tiny_layer_types(count: int, linear: str = "linear_attention") -> list[str]:
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
    layer_types = tiny_layer_types(num_hidden_layers)
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


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for a server started in another process)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
