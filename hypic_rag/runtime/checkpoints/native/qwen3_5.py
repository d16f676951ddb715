"""Qwen3.5 (dense, text stack) built from a checkpoint without transformers.

The module tree has the names and parameter shapes of transformers' `Qwen3_5ForCausalLM` (`model.embed_tokens`,
`model.layers[i].linear_attn` / `.self_attn`, `.mlp`, the norms, `model.norm`, `model.rotary_emb`, `lm_head`), so
the family adapter (`runtime/families/qwen.py`) builds the same blocks over it and its state dict has the same
names (the weights digest, and so the fingerprint, is the same). Only what the runtime calls is implemented: the
norms, the MLP, the rotary table and the parameters; the mixers' arithmetic is the runtime's own
(`mixers/gated_deltanet.py`, `mixers/attention.py`). Tested against transformers' forward
(tests/runtime/test_native_models.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hypic_rag.runtime.checkpoints.native.config import CheckpointConfig

MODEL_TYPES = ("qwen3_5_text", "qwen3_5")
"""`config.model_type` values served: the text checkpoint, and the multimodal one (its `text_config`; the text stack
weights under `model.language_model.*`)."""

TEXT_CONFIG_KEYS = (
    "architectures", "attention_bias", "attention_dropout", "bos_token_id", "eos_token_id", "head_dim", "hidden_act",
    "hidden_size", "initializer_range", "intermediate_size", "layer_types", "linear_conv_kernel_dim",
    "linear_key_head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_value_head_dim",
    "max_position_embeddings", "model_type", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
    "pad_token_id", "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "use_cache", "vocab_size",
)
"""Every key transformers' `Qwen3_5TextConfig.to_dict()` holds, but those `config_digest` ignores: a text config
holding all of them reads the same values as transformers' would (tests/runtime/test_native_models.py compares)."""


TEXT_CONFIG_DEFAULTS = {
    "architectures": None, "bos_token_id": None, "pad_token_id": None, "eos_token_id": None, "attention_bias": False,
    "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True, "tie_word_embeddings": False,
}
"""The values transformers' `Qwen3_5TextConfig` gives these keys when a config.json leaves them out (hub checkpoints
leave out the first three): `text_config` fills them the same way (tests compare with transformers' class)."""


def text_config(top: CheckpointConfig) -> CheckpointConfig:
    """The text config of a checkpoint's config.json: its `text_config` (multimodal) or itself, with
    `TEXT_CONFIG_DEFAULTS` for the keys it leaves out."""
    return CheckpointConfig({**TEXT_CONFIG_DEFAULTS, **top.get_text_config().to_dict()})


ROTARY_KEYS = ("rope_type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")
"""The keys a `rope_parameters` dict may hold for a native build (the last two only place text positions, which are
the same in M-RoPE's three streams). `rope_type` must be "default", and `rope_theta` and `partial_rotary_factor`
must be there: transformers fills them from elsewhere when they are not (`LEGACY_ROTARY_KEYS`, its class default of
0.25, its default theta)."""

LEGACY_ROTARY_KEYS = ("rope_scaling", "rope_theta", "partial_rotary_factor")
"""Config-level keys transformers' `convert_rope_params_to_dict` merges into `rope_parameters` (a `rope_scaling`
replaces it whole): a config holding one is read the way transformers reads it only by transformers."""

LAYER_TYPES = ("linear_attention", "full_attention")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def rotary_problem(config: CheckpointConfig) -> str | None:
    """Why the rotary settings of `config` (a text config, or the outer config of a multimodal checkpoint) might be
    read otherwise by transformers than by `RotaryEmbedding` (one line), or None: every setting in one
    `rope_parameters` dict of `ROTARY_KEYS`, none of `LEGACY_ROTARY_KEYS` beside it."""
    values = config.to_dict()
    legacy = [key for key in LEGACY_ROTARY_KEYS if key in values]
    if legacy:
        return f"{legacy[0]} beside rope_parameters (transformers merges it in)"
    rope = values.get("rope_parameters")
    if not isinstance(rope, dict):
        return f"rope_parameters is {type(rope).__name__}, not a dict of {', '.join(ROTARY_KEYS[:3])}"
    unknown = sorted(key for key in rope if key not in ROTARY_KEYS)
    if unknown:
        return f"rope_parameters holds {unknown[0]}"
    if rope.get("rope_type") != "default":
        return f"rope_type {rope.get('rope_type')!r} (the native rotary table is the default one)"
    for key in ("rope_theta", "partial_rotary_factor"):
        if not _is_number(rope.get(key)):
            return f"rope_parameters lacks a numeric {key} (transformers fills it in)"
    if not 0 < rope["partial_rotary_factor"] <= 1 or rope["rope_theta"] <= 0:
        return "rope_parameters out of range"
    return None


def unsupported_reason(text: CheckpointConfig) -> str | None:
    """Why this implementation does not serve `text` exactly as transformers would (one line), or None.

    Anything read otherwise than transformers' `Qwen3_5TextConfig` reads it is a reason: a key it fills in, an
    activation other than SiLU (the MLP's and the conv's), rotary settings outside one plain `rope_parameters` dict
    (`rotary_problem`), `layer_types` that is not one known type per layer."""
    missing = text.missing(TEXT_CONFIG_KEYS)
    if missing:
        return f"config.json lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
    if text.hidden_act != "silu":
        return f"hidden_act {text.hidden_act!r}"
    rotary = rotary_problem(text)
    if rotary is not None:
        return rotary
    if text.attention_bias:
        return "attention_bias"
    sizes = (text.num_hidden_layers, text.hidden_size, text.num_attention_heads, text.vocab_size)
    if not all(isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in sizes):
        return "a layer count or size that is not a positive integer"
    layer_types = text.layer_types
    if not isinstance(layer_types, list) or len(layer_types) != text.num_hidden_layers:
        count = len(layer_types) if isinstance(layer_types, list) else type(layer_types).__name__
        return f"layer_types ({count}) is not one type per layer ({text.num_hidden_layers})"
    if any(kind not in LAYER_TYPES for kind in layer_types):
        return "a layer type other than linear_attention / full_attention"
    return None


_META = torch.device("meta")
"""Where the modules' parameters are made: shapes only, the checkpoint's tensors are assigned afterwards (`torch.device`
as a context would route initialisation through torch's reference ops, which import torch._dynamo: ~1 s)."""


def _linear(inputs: int, outputs: int, bias: bool = False) -> nn.Linear:
    return nn.Linear(inputs, outputs, bias=bias, device=_META)


class ZeroCenteredRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32, cast back to x's dtype: x [..., dim] -> [..., dim]."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, device=_META))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return (hidden * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """weight * x / rms(x) (in x's dtype), times silu(gate) in float32: x, gate [..., dim] -> [..., dim]."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(dim, device=_META))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        hidden = self.weight * hidden.to(dtype)
        return (hidden * F.silu(gate.float())).to(dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): x [..., hidden] -> [..., hidden]."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = _linear(hidden, intermediate, bias=False)
        self.up_proj = _linear(hidden, intermediate, bias=False)
        self.down_proj = _linear(intermediate, hidden, bias=False)
        self.act_fn = F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class RotaryEmbedding(nn.Module):
    """The text positions' rotary tables: forward(x, position_ids [1, T]) -> cos, sin [1, T, R] in x's dtype, R =
    the rotated dims (head_dim * partial_rotary_factor), the frequencies repeated twice (half-split rotation).

    Qwen3.5's M-RoPE gives a text token the same position in its three streams, which is this table."""

    def __init__(self, text: CheckpointConfig) -> None:
        super().__init__()
        rope = text.rope_parameters
        head_dim = text.head_dim or text.hidden_size // text.num_attention_heads
        dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)


class GatedDeltaNet(nn.Module):
    """The parameters and sizes of one Gated DeltaNet layer (the arithmetic is `mixers.gated_deltanet`)."""

    def __init__(self, text: CheckpointConfig) -> None:
        super().__init__()
        self.num_v_heads, self.num_k_heads = text.linear_num_value_heads, text.linear_num_key_heads
        self.head_k_dim, self.head_v_dim = text.linear_key_head_dim, text.linear_value_head_dim
        self.key_dim, self.value_dim = self.head_k_dim * self.num_k_heads, self.head_v_dim * self.num_v_heads
        self.conv_kernel_size = text.linear_conv_kernel_dim
        self.activation = text.hidden_act  # the conv's activation, as transformers' module names it
        self.conv_dim = self.key_dim * 2 + self.value_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel_size, groups=self.conv_dim,
                                padding=self.conv_kernel_size - 1, bias=False, device=_META)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads, device=_META))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads, device=_META))
        self.norm = GatedRMSNorm(self.head_v_dim, text.rms_norm_eps)
        self.out_proj = _linear(self.value_dim, text.hidden_size, bias=False)
        self.in_proj_qkv = _linear(text.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = _linear(text.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = _linear(text.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = _linear(text.hidden_size, self.num_v_heads, bias=False)


class GatedAttention(nn.Module):
    """The parameters and sizes of one attention layer: q_proj emits the query and its sigmoid output gate, per-head
    zero-centred q/k norms (the arithmetic is `mixers.attention.ProjectedAttention`)."""

    def __init__(self, text: CheckpointConfig) -> None:
        super().__init__()
        self.config = text
        self.head_dim = text.head_dim or text.hidden_size // text.num_attention_heads
        self.scaling = self.head_dim**-0.5
        heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
        self.q_proj = _linear(text.hidden_size, heads * self.head_dim * 2, bias=False)
        self.k_proj = _linear(text.hidden_size, kv_heads * self.head_dim, bias=False)
        self.v_proj = _linear(text.hidden_size, kv_heads * self.head_dim, bias=False)
        self.o_proj = _linear(heads * self.head_dim, text.hidden_size, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, text.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, text.rms_norm_eps)


class DecoderLayer(nn.Module):
    def __init__(self, text: CheckpointConfig, layer_index: int) -> None:
        super().__init__()
        if text.layer_types[layer_index] == "linear_attention":
            self.linear_attn = GatedDeltaNet(text)
        else:
            self.self_attn = GatedAttention(text)
        self.mlp = GatedMLP(text.hidden_size, text.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(text.hidden_size, text.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(text.hidden_size, text.rms_norm_eps)


class TextModel(nn.Module):
    def __init__(self, text: CheckpointConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(
            text.vocab_size, text.hidden_size, text.pad_token_id,
            _weight=torch.empty(text.vocab_size, text.hidden_size, device=_META),  # no initialisation
        )
        self.layers = nn.ModuleList(DecoderLayer(text, index) for index in range(text.num_hidden_layers))
        self.norm = ZeroCenteredRMSNorm(text.hidden_size, text.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(text)


class CausalLM(nn.Module):
    """`model` (the text stack) and `lm_head`; `config` the text config, `generation_config` what
    generation_config.json says (None without one)."""

    native = True
    """Built by `runtime.native` (`HybridModel.implementation`)."""

    def __init__(self, text: CheckpointConfig, generation_config: Any | None = None) -> None:
        super().__init__()
        self.config = text
        self.generation_config = generation_config
        self.model = TextModel(text)
        self.lm_head = _linear(text.hidden_size, text.vocab_size, bias=False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "a natively loaded model has no forward of its own: drive it through hypic_rag's Engine, or load it with "
            "implementation='transformers' for transformers' forward"
        )
