"""Tiny random hybrid models and tokenizers, for tests and benchmarks (no network, seconds to build).

`tiny_config` gives a small transformers config of a supported hybrid family; `build_tiny_model` instantiates it
with seeded random weights, optionally with slow linear-attention decays (so composition bugs cannot hide behind
fast forgetting) and sharpened q/k norms (so attention is not uniform and position errors show);
`save_tiny_checkpoint` writes a loadable local checkpoint directory with a trained byte-level BPE tokenizer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

SUPPORTED_TINY_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def tiny_config(model_type: str = "qwen3_5", *, vocab_size: int = 256, num_hidden_layers: int = 4, **overrides: Any):
    """A small config of `model_type` (3 linear layers : 1 attention layer by default), fp32."""
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
    model_type: str = "qwen3_5",
    *,
    seed: int = 0,
    slow_decay: bool = True,
    qk_norm_scale: float | None = 2.5,
    config: Any | None = None,
    **overrides: Any,
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
    path: str | Path,
    texts: Iterable[str],
    *,
    model_type: str = "qwen3_5",
    seed: int = 0,
    tokenizer_vocab_size: int = 512,
    **overrides: Any,
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
