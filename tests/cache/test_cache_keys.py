"""Cache namespaces: validated, and every field separates keys."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hypic_rag.cache.keys import FORMAT_VERSION, KEY_BYTES, CacheNamespace, segment_key, split_key, token_ids_digest

BASE = CacheNamespace(model_fingerprint="model-a", tokenizer_fingerprint="tok-a", seam_tokens=8)


@pytest.mark.parametrize(
    "change",
    [
        {"model_fingerprint": "model-b"},
        {"tokenizer_fingerprint": "tok-b"},
        {"seam_tokens": 4},
        {"cache_format": "int8"},
        {"format_version": FORMAT_VERSION + 1},
        {"model_dtype": "bfloat16"},
    ],
)
def test_each_namespace_field_changes_the_key(change: dict) -> None:
    other = dataclasses.replace(BASE, **change)
    assert segment_key(other, [1, 2, 3]) != segment_key(BASE, [1, 2, 3])
    assert other.canonical() != BASE.canonical()


def test_key_layout_and_token_digest() -> None:
    key = segment_key(BASE, [1, 2, 3])
    assert len(key) == KEY_BYTES
    namespace_part, token_part = split_key(key)
    assert namespace_part == BASE.digest()
    assert token_part == token_ids_digest(torch.tensor([1, 2, 3])) == token_ids_digest([1, 2, 3])
    assert segment_key(BASE, [1, 2, 3]) != segment_key(BASE, [1, 2, 3, 0])
    assert segment_key(BASE, [256]) != segment_key(BASE, [1, 0])  # no collision by byte packing
    with pytest.raises(ValueError):
        split_key(key[:-1])


@pytest.mark.parametrize(
    "fields",
    [
        {"model_fingerprint": ""},
        {"tokenizer_fingerprint": 3},
        {"seam_tokens": -1},
        {"seam_tokens": True},
        {"seam_tokens": 2.0},
        {"cache_format": "float8"},
        {"format_version": 0},
        {"model_dtype": "int8"},
    ],
)
def test_bad_namespaces_are_refused(fields: dict) -> None:
    values = dict(model_fingerprint="m", tokenizer_fingerprint="t", seam_tokens=8) | fields
    with pytest.raises(ValueError):
        CacheNamespace(**values)


def test_namespace_is_frozen_and_slotted() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        BASE.seam_tokens = 2  # type: ignore[misc]
    assert not hasattr(BASE, "__dict__")
