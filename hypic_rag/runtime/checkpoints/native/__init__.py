"""Hybrid models built straight from a checkpoint directory, without importing transformers.

Importing transformers and its model code would be most of a one-shot `hypic-rag ask` (docs/verification.md,
"Start-up of a one-shot `ask`"). For the families implemented here (Qwen3.5 dense: the bundled default
model's), `load_native` builds a module tree with transformers' names and shapes from config.json and the
safetensors files, and `runtime.model.load_model` drives it as it drives transformers' model (same blocks, same
fingerprint, same outputs: tests/runtime/test_native_models.py). Every other checkpoint loads through transformers,
as does any checkpoint whose config this implementation does not reproduce exactly (the reason is logged).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hypic_rag.runtime.checkpoints.files import WEIGHTS_FILE, WEIGHTS_INDEX_FILE, read_json
from hypic_rag.runtime.checkpoints.native import qwen3_5
from hypic_rag.runtime.checkpoints.native.config import CheckpointConfig

IMPLEMENTATIONS = ("auto", "native", "transformers")
"""How `load_model` builds a checkpoint's modules: "native" (this package; an error when it cannot), "transformers"
(transformers' model classes), "auto" (native when it can, else transformers)."""


@dataclass(frozen=True, slots=True)
class NativeModel:
    """A natively built model: `model` (a `qwen3_5.CausalLM`, weights loaded, in eval mode) and its text config."""

    model: nn.Module
    config: CheckpointConfig


def _tensor_files(path: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file holding it (single file or sharded with an index)."""
    single = path / WEIGHTS_FILE
    index = path / WEIGHTS_INDEX_FILE
    if index.is_file():
        return {name: path / shard for name, shard in read_json(index)["weight_map"].items()}
    if single.is_file():
        from safetensors import safe_open

        with safe_open(single, framework="pt") as handle:
            return {name: single for name in handle.keys()}
    raise FileNotFoundError(f"no safetensors weights in {path}")


def _read_tensors(files: dict[str, Path], wanted: dict[str, str],
                  on_missing: Callable[[list[str]], BaseException]) -> dict[str, torch.Tensor]:
    """`wanted`: our name -> checkpoint name; returns our name -> tensor (CPU, the file's dtype). When the files lack
    some, raises `on_missing(their checkpoint names, sorted)`."""
    from safetensors import safe_open

    missing = sorted(source for source in wanted.values() if source not in files)
    if missing:
        raise on_missing(missing)
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for ours, source in wanted.items():
        by_file.setdefault(files[source], []).append((ours, source))
    tensors: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as handle:
            for ours, source in names:
                tensors[ours] = handle.get_tensor(source)
    return tensors


def _generation_config(path: Path) -> Any | None:
    file = path / "generation_config.json"
    if not file.is_file():
        return None
    try:
        return CheckpointConfig(read_json(file))
    except (OSError, ValueError):
        return None


def unsupported_reason(path: Path) -> str | None:
    """Why this package does not build the checkpoint in `path` exactly as transformers would (one line), or None.
    Reads config.json and lists the weight files only."""
    try:
        raw = read_json(path / "config.json")
    except (OSError, ValueError) as error:
        return f"config.json unreadable ({error})"
    if not isinstance(raw, dict) or not isinstance(raw.get("text_config", {}), dict):
        return "config.json (or its text_config) is not a JSON object"
    top = CheckpointConfig(raw)
    model_type = getattr(top, "model_type", None)
    if model_type not in qwen3_5.MODEL_TYPES:
        return f"model type {model_type!r} has no native implementation"
    if not (path / "model.safetensors").is_file() and not (path / "model.safetensors.index.json").is_file():
        return "no safetensors weights (pytorch_model.bin loads through transformers)"
    if getattr(top, "text_config", None) is not None:  # transformers' outer config reads its own rotary keys too
        outer = {key: value for key, value in top.to_dict().items() if key in qwen3_5.LEGACY_ROTARY_KEYS}
        if outer:
            return f"{next(iter(outer))} beside text_config"
    return qwen3_5.unsupported_reason(qwen3_5.text_config(top))


def _lacking(missing: list[str]) -> BaseException:
    return KeyError(f"the weights lack {missing[0]}")


def load_native(path: Path, *, device: torch.device, dtype: torch.dtype,
                on_missing: Callable[[list[str]], BaseException] = _lacking) -> NativeModel:
    """Build the checkpoint in `path` (already checked by `runtime.model.check_model_directory`, and
    `unsupported_reason(path)` None) on `device` in `dtype`. Weights lacking declared tensors raise
    `on_missing(their names, sorted)` (default a KeyError); a damaged checkpoint OSError, ValueError, KeyError or
    safetensors' error."""
    top = CheckpointConfig(read_json(path / "config.json"))
    reason = unsupported_reason(path)
    if reason is not None:
        raise ValueError(reason)
    multimodal = getattr(top, "text_config", None) is not None
    text = qwen3_5.text_config(top)
    tied = bool(getattr(top, "tie_word_embeddings", False))
    model = qwen3_5.CausalLM(text, _generation_config(path))  # parameters on the meta device
    stack_prefix = "model.language_model." if multimodal else "model."
    wanted = {name: (stack_prefix + name.removeprefix("model.") if name.startswith("model.") else name)
              for name in model.state_dict()}
    if tied:
        wanted.pop("lm_head.weight")
    files = _tensor_files(path)
    read = _read_tensors(files, wanted, on_missing)
    tensors = {name: tensor.to(device=device, dtype=dtype) for name, tensor in read.items()}
    if tied:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    model.load_state_dict(tensors, strict=True, assign=True)
    model.model.rotary_emb = qwen3_5.RotaryEmbedding(text).to(device)  # its table is not in the checkpoint
    return NativeModel(model=model.eval(), config=text)
