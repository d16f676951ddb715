"""A checkpoint's config.json as the runtime reads it, without transformers' config classes.

`CheckpointConfig` answers attribute reads (`config.hidden_size`, `getattr(config, "head_dim", None)`) from the
file's own values and `to_dict()` with them, as a transformers config does for the keys the file holds. A native
implementation (`runtime/checkpoints/native/`) serves a config only when the file holds every key transformers' config class
would fill in (`require_keys`): then the two kinds of config read the same values and give the same
`runtime.model.config_digest`, so a model loaded either way gets the same fingerprint (and cache entries).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any


class CheckpointConfig:
    """Attribute access over a config dict (a checkpoint's config.json, or its `text_config` part).

    Unknown attributes raise AttributeError, so `getattr(config, name, default)` works as on a transformers config.
    `text_config`: the nested text config of a multimodal checkpoint (a `CheckpointConfig`), when present.
    """

    __slots__ = ("_values",)

    def __init__(self, values: dict[str, Any]) -> None:
        object.__setattr__(self, "_values", copy.deepcopy(dict(values)))

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            value = values[name]
            return CheckpointConfig(value) if name == "text_config" and isinstance(value, dict) else value
        raise AttributeError(f"config has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a CheckpointConfig is read-only")

    def __repr__(self) -> str:
        return f"CheckpointConfig(model_type={self._values.get('model_type')!r})"

    def to_dict(self) -> dict[str, Any]:
        """The values as a new dict (nested dicts copied)."""
        return copy.deepcopy(self._values)

    def get_text_config(self) -> CheckpointConfig:
        """The text config: `text_config` when present, else this config."""
        text = self._values.get("text_config")
        return CheckpointConfig(text) if isinstance(text, dict) else self

    def missing(self, keys: Iterable[str]) -> list[str]:
        """The keys of `keys` this config does not hold, sorted."""
        return sorted(key for key in keys if key not in self._values)
