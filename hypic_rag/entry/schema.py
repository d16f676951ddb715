"""The segment entry format, shared by the runtime (which makes and composes entries) and the cache (which stores
them). A leaf module: it imports nothing from hypic_rag, so both sides can depend on it.

An entry is a plain ``dict[str, torch.Tensor]`` (docs/CONTRACTS.md): ``token_ids`` int64 [L]; ``seam_tokens`` int64
[] (the seam window w it was encoded for); per recurrent mixer of layer i ``layers.{i}.transition`` (P, shaped by
the mixer's transition kind: [H, K, K] for Gated DeltaNet's matrix, [H, 1, 1] for a scalar decay, ...),
``layers.{i}.suffix_state`` (Z, the mixer's state shape: [H, K, V] for Gated DeltaNet), ``layers.{i}.conv_tail``
[conv channels, kernel-1] (a mixer without a recurrent state stores only its conv tail); per attention mixer
``layers.{i}.key`` / ``layers.{i}.value`` [H_kv, L, D] (keys before any position). A layer holds at most one mixer
of each kind, so a parallel layer (attention beside an SSM) has both sets. Names ending ``.key`` / ``.value`` are
K/V; every other tensor but ``token_ids`` (and the scalar ``seam_tokens``) is linear state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

Entry = dict[str, "torch.Tensor"]
"""A segment entry: tensor name -> tensor (CPU tensors as encoded, stored and decoded)."""

TOKEN_IDS = "token_ids"
SEAM_TOKENS = "seam_tokens"

LINEAR_LAYER = "linear_attention"
ATTENTION_LAYER = "full_attention"
MLP_LAYER = "mlp"
LAYER_KINDS = (LINEAR_LAYER, ATTENTION_LAYER)
"""The mixer kinds of a hybrid stack, as transformers' ``config.layer_types`` names them. A layer's kind is one of
them, both joined by "+" (attention and a recurrent mixer side by side), or `MLP_LAYER` (no mixer)."""

LINEAR_PARTS = ("transition", "suffix_state", "conv_tail")
"""The tensors of a recurrent mixer: P, Z and the conv tail (shapes set by the mixer; Gated DeltaNet: [H, K, K],
[H, K, V], [conv_dim, kernel-1])."""
ATTENTION_PARTS = ("key", "value")
"""The tensors of an attention layer: pre-RoPE keys and values [H_kv, L, D]."""
KEY_VALUE_SUFFIXES = tuple(f".{part}" for part in ATTENTION_PARTS)

STORED_PART_SEPARATOR = "#"
"""A compressed tensor is stored as parts named ``{name}#{part}`` (``layers.3.key#int8`` and ``layers.3.key#scale``,
`hypic_rag.entry`); the name before the separator says which tensor, and so which kind, they make."""


def base_name(name: str) -> str:
    """The tensor a stored part belongs to (``layers.3.key#int8`` -> ``layers.3.key``); other names unchanged."""
    return name.partition(STORED_PART_SEPARATOR)[0]


def tensor_name(layer_index: int, part: str) -> str:
    """The entry name of layer `layer_index`'s tensor `part` (one of `LINEAR_PARTS` or `ATTENTION_PARTS`)."""
    return f"layers.{layer_index}.{part}"


def layer_parts(kind: str) -> tuple[str, ...]:
    """The tensor parts an entry holds for a layer of `kind` (ValueError for an unknown kind)."""
    if kind == MLP_LAYER:
        return ()
    parts: tuple[str, ...] = ()
    for mixer_kind in kind.split("+"):
        if mixer_kind == LINEAR_LAYER:
            parts += LINEAR_PARTS
        elif mixer_kind == ATTENTION_LAYER:
            parts += ATTENTION_PARTS
        else:
            raise ValueError(f"unknown layer kind {kind!r}; expected one of {', '.join(LAYER_KINDS)}")
    return parts


def is_kv_name(name: str) -> bool:
    """True for attention K/V tensors (and the stored parts of a compressed one)."""
    return base_name(name).endswith(KEY_VALUE_SUFFIXES)


@dataclass(frozen=True, slots=True)
class EntryBytes:
    """Byte sizes of an entry's tensors, split by kind (token ids and any header are in neither of the first two)."""

    linear_bytes: int
    kv_bytes: int
    token_id_bytes: int

    @property
    def tensor_bytes(self) -> int:
        """Every tensor's bytes together: what an entry holds in memory."""
        return self.linear_bytes + self.kv_bytes + self.token_id_bytes


def entry_bytes(entry: Mapping[str, Any]) -> EntryBytes:
    """Bytes of an entry's tensors as held (stored parts of a compressed entry included: codes and scales), split
    into linear state, K/V and token ids.

    The one way entry sizes are computed: the cache's statistics, the in-memory byte budgets (`tensor_bytes`),
    precompute's commit batches and the benchmarks all use it.
    """
    linear = kv = token_ids = 0
    for name, tensor in entry.items():
        size = tensor.numel() * tensor.element_size()
        if name == TOKEN_IDS:
            token_ids += size
        elif is_kv_name(name):
            kv += size
        else:
            linear += size
    return EntryBytes(linear_bytes=linear, kv_bytes=kv, token_id_bytes=token_ids)


def entry_tensor_bytes(entry: Mapping[str, Any]) -> int:
    """`entry_bytes(entry).tensor_bytes`: the size of an entry for byte budgets."""
    return entry_bytes(entry).tensor_bytes


MAX_SEAM_TOKENS = 65_536
"""The widest seam window accepted anywhere (a seam at least as long as a segment recomputes it whole, so a wider one
adds nothing; `hypic_rag.utils.limits.SEAM_TOKENS` is this range)."""


def check_seam_tokens(value: object, name: str = "seam_tokens") -> int:
    """`value` if it is a valid seam window w (an int in 0..MAX_SEAM_TOKENS), else ValueError naming `name`.

    The one check of a seam width, wherever one is configured (engine, encoder, cache namespace, index settings,
    manifest, precompute, a recompute policy); a seam wider than a segment simply recomputes the whole segment.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEAM_TOKENS:
        shown = value if not isinstance(value, int) or len(str(value)) <= 24 else f"{str(value)[:12]}..."
        raise ValueError(f"{name} must be an integer in 0..{MAX_SEAM_TOKENS}, got {shown!r}")
    return value
