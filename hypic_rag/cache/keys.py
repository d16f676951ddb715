"""Cache namespaces and key derivation.

A key must never let one model's state be served to another, so it is derived from everything that changes what
an entry contains: the model fingerprint (config plus a digest of the weights), the dtype the model ran in, the
tokenizer fingerprint, the seam window, the cache format the tensors are stored in (`hypic_rag.entry`), the
entry format version, and the sha256 of the chunk's token ids. Entries of different formats therefore never mix.

Key layout (48 bytes): ``namespace_digest (16) | token_ids_digest (32)``. The namespace comes first so that all
entries of one namespace are contiguous in the store. A hit additionally compares the namespace recorded in the
entry's header and the stored token ids (see `segment_cache`), so even a digest collision cannot return a wrong entry.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch

from hypic_rag.entry.schema import check_seam_tokens
from hypic_rag.entry.compression import CACHE_FORMATS, DEFAULT_CACHE_FORMAT, CacheFormat, cache_format

FORMAT_VERSION = 2  # 2: entries no longer carry a chunk_state per linear layer
"""Version of the entry contents (tensor names and meaning, see docs/CONTRACTS.md). Bump when they change."""

MODEL_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
"""The dtypes a model may run in (`model_dtype`)."""

NAMESPACE_DIGEST_BYTES = 16
TOKEN_DIGEST_BYTES = 32
KEY_BYTES = NAMESPACE_DIGEST_BYTES + TOKEN_DIGEST_BYTES


@dataclass(frozen=True, slots=True)
class CacheNamespace:
    """Everything besides the token ids that decides what a cached entry contains.

    model_fingerprint: config plus a digest of the weights (from the runtime's model loader).
    tokenizer_fingerprint: identifies the tokenizer (vocabulary, merges, special tokens).
    seam_tokens: the seam window w; the cached suffix pair covers tokens w..L-1, so each w has its own entries.
    cache_format: the format the entry's tensors are stored in, a name of
    `hypic_rag.entry.compression.CACHE_FORMATS` (``float32``: as encoded; ``int8``, ``int4``, ...: compressed).
    format_version: entry contents version, `FORMAT_VERSION` unless reading a store written by another release.
    model_dtype: the dtype the model's weights were loaded in (`--dtype`), one of `MODEL_DTYPES`' names: the
    same checkpoint run in bfloat16 encodes other states than in float32. (The fingerprint, a digest of the loaded
    weights, differs too; the field says so explicitly.)
    """

    model_fingerprint: str
    tokenizer_fingerprint: str
    seam_tokens: int
    cache_format: str = DEFAULT_CACHE_FORMAT
    format_version: int = FORMAT_VERSION
    model_dtype: str = "float32"

    def __post_init__(self) -> None:
        for field_name in ("model_fingerprint", "tokenizer_fingerprint"):
            value = getattr(self, field_name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"CacheNamespace.{field_name} must be a non-empty string, got {value!r}")
        check_seam_tokens(self.seam_tokens, "CacheNamespace.seam_tokens")
        if self.cache_format not in CACHE_FORMATS:
            raise ValueError(f"CacheNamespace.cache_format must be one of {', '.join(CACHE_FORMATS)}, "
                             f"got {self.cache_format!r}")
        if self.model_dtype not in MODEL_DTYPES:
            raise ValueError(f"CacheNamespace.model_dtype must be one of {sorted(MODEL_DTYPES)}, got {self.model_dtype!r}")
        if isinstance(self.format_version, bool) or not isinstance(self.format_version, int) or self.format_version < 1:
            raise ValueError(f"CacheNamespace.format_version must be an int >= 1, got {self.format_version!r}")

    @classmethod
    def for_model(cls, model: Any, seam_tokens: int, cache_format: str = DEFAULT_CACHE_FORMAT) -> CacheNamespace:
        """The namespace of `model`'s entries (anything with ``fingerprint`` and ``tokenizer_fingerprint``, such
        as a `hypic_rag.runtime.model.HybridModel`) for seam window `seam_tokens`, stored in `cache_format`."""
        return cls(
            model_fingerprint=model.fingerprint,
            tokenizer_fingerprint=model.tokenizer_fingerprint,
            seam_tokens=seam_tokens,
            cache_format=cache_format,
            model_dtype=getattr(model, "dtype_name", "float32"),
        )

    def with_seam(self, seam_tokens: int) -> CacheNamespace:
        """This namespace for another seam window (each seam width has its own entries)."""
        return self if seam_tokens == self.seam_tokens else replace(self, seam_tokens=seam_tokens)

    @property
    def storage_format(self) -> CacheFormat:
        """The `CacheFormat` entries of this namespace are stored in."""
        return cache_format(self.cache_format)

    def canonical(self) -> str:
        """A stable text form (sorted-key JSON), recorded in every entry header and hashed into the key."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    def digest(self) -> bytes:
        """The first `NAMESPACE_DIGEST_BYTES` bytes of sha256(canonical()) (computed once per namespace: every
        segment key of a request starts with it)."""
        return _digest_of(self)


@functools.lru_cache(maxsize=256)
def _digest_of(namespace: CacheNamespace) -> bytes:
    return namespace_digest(namespace.canonical())


def namespace_digest(canonical_text: str) -> bytes:
    """Key prefix of a namespace given its canonical text (as recorded in entry headers)."""
    return hashlib.sha256(canonical_text.encode("utf-8")).digest()[:NAMESPACE_DIGEST_BYTES]


def token_ids_bytes(token_ids: Sequence[int] | torch.Tensor) -> bytes:
    """The token ids as little-endian int64 bytes (the form that is hashed), shape [L] -> 8 * L bytes."""
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().reshape(-1).tolist()
    return np.asarray(token_ids, dtype="<i8").reshape(-1).tobytes()


def token_ids_digest(token_ids: Sequence[int] | torch.Tensor) -> bytes:
    """sha256 of the little-endian int64 token ids (32 bytes)."""
    return hashlib.sha256(token_ids_bytes(token_ids)).digest()


def segment_key(namespace: CacheNamespace, token_ids: Sequence[int] | torch.Tensor) -> bytes:
    """The store key of a chunk: namespace digest (16 bytes) then sha256 of its token ids (32 bytes)."""
    return namespace.digest() + token_ids_digest(token_ids)


def key_label(key: bytes) -> str:
    """A short name of a segment key for logs: the first 4 bytes of its namespace digest and the first 8 of its
    token ids digest in hex (``ns/tokens``); the key's first bytes alone are the same for a whole namespace."""
    return f"{key[:4].hex()}/{key[NAMESPACE_DIGEST_BYTES:NAMESPACE_DIGEST_BYTES + 8].hex()}"


def split_key(key: bytes) -> tuple[bytes, bytes]:
    """(namespace digest, token ids digest) of a key made by `segment_key`; ValueError for any other length."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a segment key has {KEY_BYTES} bytes, got {len(key)}")
    return key[:NAMESPACE_DIGEST_BYTES], key[NAMESPACE_DIGEST_BYTES:]
