"""A BERT encoder in plain torch, read from a hub checkpoint directory without transformers.

Importing transformers costs one to three seconds (it pulls in torch._dynamo and torch.distributed); a one-shot
`ask` only needs the sentence embedder's forward. `load_bert_encoder` reads config.json and model.safetensors of a
checkpoint that is the plain BERT encoder (model_type "bert", absolute position embeddings, post-LayerNorm layers,
exact gelu) and returns a `BertEncoder`; for anything else it returns None and the caller keeps transformers'
`AutoModel`, which is also the reference this module is tested against (tests/retrieval/test_embeddings.py).

Every sequence is encoded with token type 0, as a tokenizer does for one text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from hypic_rag.runtime.checkpoints.files import CONFIG_FILE, WEIGHTS_FILE, read_json

logger = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class BertShape:
    """The sizes of a plain BERT encoder, from its config.json."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float

    def __post_init__(self) -> None:
        sizes = (self.vocab_size, self.hidden_size, self.num_hidden_layers, self.num_attention_heads,
                 self.intermediate_size, self.max_position_embeddings, self.type_vocab_size)
        if min(sizes) < 1:
            raise ValueError(f"BERT sizes must be positive, got {self}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of {self.num_attention_heads} heads")
        if not self.layer_norm_eps > 0:
            raise ValueError(f"layer_norm_eps must be positive, got {self.layer_norm_eps}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> BertShape | None:
        """The shape of `config` (a config.json's contents) when it is a plain BERT encoder; None for anything this
        module does not run the way transformers' BertModel does (relative positions, another activation, a
        decoder, cross-attention, another model type)."""
        if config.get("model_type") != "bert":
            return None
        if config.get("position_embedding_type", "absolute") != "absolute" or config.get("hidden_act") != "gelu":
            return None
        if config.get("is_decoder") or config.get("add_cross_attention"):
            return None
        try:
            return cls(vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
                       num_hidden_layers=int(config["num_hidden_layers"]),
                       num_attention_heads=int(config["num_attention_heads"]),
                       intermediate_size=int(config["intermediate_size"]),
                       max_position_embeddings=int(config["max_position_embeddings"]),
                       type_vocab_size=int(config["type_vocab_size"]),
                       layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)))
        except (KeyError, TypeError, ValueError):
            return None


class BertLayer(nn.Module):
    """One post-LayerNorm encoder layer: self-attention, add, LayerNorm; gelu MLP, add, LayerNorm."""

    def __init__(self, shape: BertShape) -> None:
        super().__init__()
        hidden = shape.hidden_size
        self.num_heads = shape.num_attention_heads
        self.head_dim = shape.head_dim
        self.query_key_value = nn.Linear(hidden, 3 * hidden)  # the three projections as one matmul
        self.attention_output = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=shape.layer_norm_eps)
        self.intermediate = nn.Linear(hidden, shape.intermediate_size)
        self.output = nn.Linear(shape.intermediate_size, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=shape.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, padding: Padding) -> torch.Tensor:
        """hidden [rows, hidden_size]: the batch's real tokens packed sequence after sequence (`padding` says where
        each goes in the padded batch [batch, tokens]; every row when nothing is padded) -> the same shape. The
        token-wise products run on the real tokens only; attention, per sequence, on the padded batch with padded
        keys masked."""
        width = hidden.shape[-1]
        mixed = self.query_key_value(hidden)  # [rows, 3 * hidden]
        batch, tokens, attend = padding.batch, padding.tokens, padding.attend
        if padding.rows is not None:
            mixed = padding.spread(mixed)  # [batch * tokens, 3 * hidden], zeros at padded rows
        # [batch, tokens, 3 * hidden] -> [3, batch, heads, tokens, head_dim]
        query, key, value = (mixed.view(batch, tokens, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4))
        attended = functional.scaled_dot_product_attention(query, key, value, attn_mask=attend)
        attended = attended.transpose(1, 2).reshape(batch * tokens, width)  # [batch * tokens, hidden]
        if padding.rows is not None:
            attended = attended[padding.rows]  # [rows, hidden]
        hidden = self.attention_norm(self.attention_output(attended) + hidden)
        return self.output_norm(self.output(functional.gelu(self.intermediate(hidden))) + hidden)


@dataclass(frozen=True, slots=True)
class Padding:
    """Where the real tokens of a padded batch [batch, tokens] are: `rows` [real] their flat positions in
    batch * tokens (row-major: sequence after sequence), `attend` [batch, 1, 1, tokens] bool (True: a real key);
    both None when no token is padding."""

    rows: torch.Tensor | None
    batch: int
    tokens: int
    attend: torch.Tensor | None

    def spread(self, packed: torch.Tensor) -> torch.Tensor:
        """packed [real, width] -> [batch * tokens, width], zeros at the padded positions."""
        assert self.rows is not None
        padded = packed.new_zeros(self.batch * self.tokens, packed.shape[-1])
        padded[self.rows] = packed
        return padded


class BertEncoder(nn.Module):
    """Embeddings (word + absolute position + token type 0, LayerNorm) and the encoder layers; no pooler."""

    def __init__(self, shape: BertShape) -> None:
        super().__init__()
        self.shape = shape
        self.word_embeddings = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.position_embeddings = nn.Embedding(shape.max_position_embeddings, shape.hidden_size)
        self.token_type_embedding = nn.Parameter(torch.zeros(shape.hidden_size))  # row 0 of the type table
        self.embedding_norm = nn.LayerNorm(shape.hidden_size, eps=shape.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(shape) for _ in range(shape.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """input_ids [batch, tokens] int; attention_mask [batch, tokens] (1: a real token, 0: padding; a token's
        position is its column, as in transformers) -> the last hidden states [batch, tokens, hidden_size] float32.
        Only the real tokens go through the token-wise products (a batch of texts of different lengths pays for its
        real tokens, not for its padding) and only real tokens are attended to; padded positions hold zeros
        (transformers computes values there, which pooling ignores)."""
        batch, tokens = input_ids.shape
        if tokens > self.shape.max_position_embeddings:
            raise ValueError(f"{tokens} tokens exceed the model's {self.shape.max_position_embeddings} positions")
        real = attention_mask.bool()
        positions = torch.arange(tokens, device=input_ids.device)
        if bool(real.all()):
            padding, ids, positions = Padding(None, batch, tokens, None), input_ids.reshape(-1), positions.repeat(batch)
        else:
            rows = real.reshape(-1).nonzero().squeeze(1)  # [real]
            padding = Padding(rows, batch, tokens, real[:, None, None, :])
            ids, positions = input_ids.reshape(-1)[rows], rows % tokens
        hidden = self.word_embeddings(ids) + self.position_embeddings(positions) + self.token_type_embedding
        hidden = self.embedding_norm(hidden)  # [rows, hidden]
        for layer in self.layers:
            hidden = layer(hidden, padding)
        if padding.rows is None:
            return hidden.view(batch, tokens, -1)
        return padding.spread(hidden).view(batch, tokens, -1)


def _checkpoint_names(shape: BertShape) -> dict[str, str | tuple[str, ...]]:
    """Our parameter name -> the checkpoint's name (without a `bert.` prefix), or the three names whose rows are
    stacked into it (query, key, value)."""
    names: dict[str, str | tuple[str, ...]] = {
        "word_embeddings.weight": "embeddings.word_embeddings.weight",
        "position_embeddings.weight": "embeddings.position_embeddings.weight",
        "embedding_norm.weight": "embeddings.LayerNorm.weight",
        "embedding_norm.bias": "embeddings.LayerNorm.bias",
    }
    for number in range(shape.num_hidden_layers):
        ours, theirs = f"layers.{number}.", f"encoder.layer.{number}."
        for kind in ("weight", "bias"):
            names[f"{ours}query_key_value.{kind}"] = tuple(
                f"{theirs}attention.self.{projection}.{kind}" for projection in ("query", "key", "value"))
            names[f"{ours}attention_output.{kind}"] = f"{theirs}attention.output.dense.{kind}"
            names[f"{ours}attention_norm.{kind}"] = f"{theirs}attention.output.LayerNorm.{kind}"
            names[f"{ours}intermediate.{kind}"] = f"{theirs}intermediate.dense.{kind}"
            names[f"{ours}output.{kind}"] = f"{theirs}output.dense.{kind}"
            names[f"{ours}output_norm.{kind}"] = f"{theirs}output.LayerNorm.{kind}"
    return names


def _layer_norm_tensor(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """A LayerNorm tensor under its name, or under the `gamma`/`beta` names of old TensorFlow conversions."""
    if name in tensors:
        return tensors[name]
    legacy = name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
    return tensors.get(legacy)


def load_bert_encoder(model_dir: Path, device: str = "cpu") -> BertEncoder | None:
    """The encoder of `model_dir` (config.json + a single model.safetensors, names as the hub writes them, with or
    without a `bert.` prefix) in float32, in eval mode on `device`; None when the directory is not a plain BERT
    encoder or a tensor is missing or misshapen (the caller then uses transformers)."""
    config_file, weights_file = model_dir / CONFIG_FILE, model_dir / WEIGHTS_FILE
    if not (config_file.is_file() and weights_file.is_file()):
        return None
    try:
        shape = BertShape.from_config(read_json(config_file))
    except (OSError, ValueError):
        return None
    if shape is None:
        return None
    from safetensors.torch import load_file

    stored = load_file(weights_file, device="cpu")
    tensors = {name.removeprefix("bert."): tensor for name, tensor in stored.items()}
    encoder = BertEncoder(shape)
    state: dict[str, torch.Tensor] = {}
    for ours, theirs in _checkpoint_names(shape).items():
        parts = [_layer_norm_tensor(tensors, name) for name in ((theirs,) if isinstance(theirs, str) else theirs)]
        if any(part is None for part in parts):
            logger.info("%s lacks %s: not run without transformers", weights_file, theirs)
            return None
        state[ours] = torch.cat(parts) if len(parts) > 1 else parts[0]  # type: ignore[arg-type]
    token_types = tensors.get("embeddings.token_type_embeddings.weight")
    if token_types is None or token_types.ndim != 2 or token_types.shape[1] != shape.hidden_size:
        logger.info("%s lacks token type embeddings: not run without transformers", weights_file)
        return None
    state["token_type_embedding"] = token_types[0]
    expected = encoder.state_dict()
    if any(state[name].shape != expected[name].shape for name in expected):
        logger.info("%s does not match the shape its config.json declares", weights_file)
        return None
    encoder.load_state_dict({name: tensor.float() for name, tensor in state.items()})
    return encoder.eval().to(device)

