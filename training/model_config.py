"""The default model's architecture: a small `qwen3_5` text model with gated-DeltaNet and full-attention layers."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Sizes of the default model. `linear_per_attention` linear layers precede each full-attention layer
    (3 gives the 3:1 pattern of the released Qwen3.5 models)."""

    hidden_size: int = 128
    num_hidden_layers: int = 8
    linear_per_attention: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    intermediate_size: int = 384

    def layer_types(self) -> list[str]:
        period = self.linear_per_attention + 1
        return [
            "full_attention" if (index + 1) % period == 0 else "linear_attention"
            for index in range(self.num_hidden_layers)
        ]

    def as_dict(self) -> dict:
        return asdict(self)


def build_config(shape: ModelShape, vocab_size: int, *, eos_token_id: int, pad_token_id: int):
    """A `Qwen3_5TextConfig` for `shape` (tied embeddings, kernel-4 convolution, partial RoPE as released)."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        layer_types=shape.layer_types(),
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        linear_num_key_heads=shape.linear_num_key_heads,
        linear_num_value_heads=shape.linear_num_value_heads,
        linear_key_head_dim=shape.linear_key_head_dim,
        linear_value_head_dim=shape.linear_value_head_dim,
        linear_conv_kernel_dim=4,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
