"""Load a hybrid model through transformers and expose the parts the runtime drives.

We reuse the model's own modules and weights (embeddings, norms, projections, MLPs / MoE blocks, rotary
embedding, LM head); only the mixer paths that must expose states, transition operators, conv tails and
pre-RoPE keys are re-implemented (in `layers.py`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hypic_rag.entry import ATTENTION_LAYER, LINEAR_LAYER

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")


class UnsupportedModelError(ValueError):
    """The checkpoint is not a hybrid family this runtime knows."""


@dataclass(slots=True)
class HybridModel:
    """A loaded hybrid causal LM and the handles the runtime needs.

    layer_types[i] is "linear_attention" or "full_attention"; `layers[i]` is the model's decoder layer.
    fingerprint: sha256 over the config and a digest of the weights (cache keys use it).
    tokenizer_fingerprint: sha256 of the tokenizer's serialised form ("none" without a tokenizer).
    """

    hf_model: nn.Module
    config: Any
    tokenizer: Any | None
    layer_types: tuple[str, ...]
    fingerprint: str
    tokenizer_fingerprint: str
    source: str = "config"
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def backbone(self) -> nn.Module:
        return self.hf_model.model

    @property
    def layers(self) -> nn.ModuleList:
        return self.backbone.layers

    @property
    def device(self) -> torch.device:
        return self.backbone.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.backbone.embed_tokens.weight.dtype

    @property
    def linear_layer_indices(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == LINEAR_LAYER]

    @property
    def attention_layer_indices(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == ATTENTION_LAYER]

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.hf_model, "generation_config", None), self.config):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden [T, hidden] -> logits [T, vocab] (float32)."""
        return self.hf_model.lm_head(self.backbone.norm(hidden)).float()


def weights_digest(module: nn.Module, samples_per_tensor: int = 1024) -> str:
    """sha256 over every parameter/buffer's name, shape, dtype and a strided sample of its values.

    Hashing every byte of a 70 GB checkpoint would cost minutes; a strided sample of each tensor changes with
    any fine-tune or different seed while staying cheap. Tests check that a single changed weight tensor changes it.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        stride = max(1, flat.numel() // samples_per_tensor)
        sample = flat[::stride][:samples_per_tensor].float().cpu().contiguous()
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        digest.update(sample.numpy().tobytes())
        digest.update(str(float(flat.float().sum())).encode())
    return digest.hexdigest()


def config_digest(config: Any) -> str:
    data = config.to_dict()
    for volatile in ("transformers_version", "_name_or_path", "_attn_implementation_autoset", "dtype", "torch_dtype"):
        data.pop(volatile, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def tokenizer_digest(tokenizer: Any | None) -> str:
    if tokenizer is None:
        return "none"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    serialised = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    extra = json.dumps({"special": tokenizer.all_special_tokens}, sort_keys=True)
    return hashlib.sha256((serialised + extra).encode()).hexdigest()


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def _check_supported(config: Any) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def wrap_model(hf_model: nn.Module, tokenizer: Any | None = None, source: str = "model") -> HybridModel:
    """Wrap an already-built transformers causal LM (eval mode is set)."""
    config = _text_config(hf_model.config)
    _check_supported(config)
    hf_model.eval()
    layer_types = tuple(config.layer_types)
    for kind in layer_types:
        if kind not in (LINEAR_LAYER, ATTENTION_LAYER):
            raise UnsupportedModelError(f"unknown layer type {kind!r}")
    fingerprint = hashlib.sha256((config_digest(config) + weights_digest(hf_model)).encode()).hexdigest()
    return HybridModel(
        hf_model=hf_model,
        config=config,
        tokenizer=tokenizer,
        layer_types=layer_types,
        fingerprint=fingerprint,
        tokenizer_fingerprint=tokenizer_digest(tokenizer),
        source=source,
    )


def load_model(
    source: str | Path | nn.Module | Any,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    tokenizer: Any | None = None,
) -> HybridModel:
    """Load a hybrid model.

    source: a local checkpoint directory (config, safetensors, tokenizer), an instantiated transformers model, or a
    transformers config (random weights). Never downloads: a missing directory is an error.
    device: defaults to CUDA when available, else CPU. dtype: defaults to float32 on CPU, bfloat16 on CUDA.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # loading is quick for our sizes; keep CLI output clean

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    if isinstance(source, nn.Module):
        model, label = source, type(source).__name__
    elif isinstance(source, PretrainedConfig):
        _check_supported(_text_config(source))
        model, label = AutoModelForCausalLM.from_config(source, dtype=dtype), "config"
    else:
        path = Path(source).expanduser()
        if not path.is_dir() or not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} does not exist or has no config.json")
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        _check_supported(_text_config(config))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        if tokenizer is None:
            try:
                tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            except (OSError, ValueError) as error:
                logger.warning("no tokenizer loaded from %s: %s", path, error)
        label = str(path)
    model = model.to(device=device, dtype=dtype)
    return wrap_model(model, tokenizer=tokenizer, source=label)
