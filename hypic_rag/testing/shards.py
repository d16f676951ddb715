"""Checkpoints in the hub's sharded safetensors layout, for the tests' published-layout stand-ins."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from hypic_rag.entry.schema import entry_tensor_bytes


def write_sharded_safetensors(path: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    """`tensors` split by sorted name over `shards` `model-0000i-of-0000n.safetensors` files in `path`, with the
    `model.safetensors.index.json` naming each tensor's file (the hub's sharded layout)."""
    from safetensors.torch import save_file

    names = sorted(tensors)
    per_shard = math.ceil(len(names) / shards)
    weight_map: dict[str, str] = {}
    for number in range(shards):
        file_name = f"model-{number + 1:05d}-of-{shards:05d}.safetensors"
        part = names[number * per_shard : (number + 1) * per_shard]
        save_file({name: tensors[name] for name in part}, str(path / file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name in part})
    total = entry_tensor_bytes(tensors)  # the bytes of a dict of tensors, as for a cache entry
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
