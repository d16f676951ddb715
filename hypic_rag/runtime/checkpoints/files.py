"""The files of a checkpoint directory as the hub writes them, read the one way every reader here reads them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
"""A single-file checkpoint's weights."""
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
"""A sharded checkpoint's index: `weight_map` names the shard of every tensor."""


def read_json(path: Path) -> Any:
    """The contents of a JSON file of a checkpoint (config.json, tokenizer.json, tokenizer_config.json, ...), read
    as UTF-8 whatever the platform's default encoding."""
    return json.loads(path.read_text(encoding="utf-8"))
