"""Anchored entries: a chunk's entry encoded after the prompt prefix (its *anchor*) instead of alone.

A chunk encoded standalone begins a sequence of its own: its first tokens take the attention a model parks on the
start of a sequence (an attention sink), and every later token of the chunk is computed against them. In the real
prompt the sink is the prompt's first token, and the chunk's first tokens are ordinary text. A model trained only on
whole prompts (`evals/stage3_model/`) reads the question's answer from the last full-attention layer's keys and
values, and those of a standalone-encoded chunk are wrong at every token, not only in a seam window
(docs/recompute_policies.md measures it: substituting that one layer's in-context K/V removes all of the loss).
Encoding the chunk after the anchor gives its tokens the context shape they have in a prompt.

No new entry format is needed: the entry of the segment `anchor + chunk`, encoded standalone as usual for seam
`len(anchor) + w`, holds
- per recurrent layer the suffix pair (P, Z) of chunk tokens w..L-1 (its inputs computed after the anchor), and the
  conv tail of the segment's last inputs (the chunk's, or the anchor's last ones for a chunk shorter than the tail);
- per attention layer the keys / values of anchor and chunk, of which the rows past the anchor are the chunk's.
So `chunk_view` of it is an entry of the chunk for seam w, and the stack composes it as any other; the cache keeps
it under its usual key (the segment's token ids and entry seam). What it costs: the anchor's tokens are encoded
again with every chunk, and its K/V rows stored with every chunk's entry (`anchored_extra_bytes`).

A chunk at position 0 (a request without a prefix) has no anchor: its anchored entry is its plain one.

*Chained entries* generalise this to documents longer than a chunk: the entry of chunk j of a document encoded after
the anchor and chunk j-1 (`chained_anchor`), read when chunk j comes right after chunk j-1 in the prompt
(`Request.chunk_follows`, the pipeline's `prompt_order` puts a document's chunks together in document order). Its
tokens then saw their real antecedent ("she", "the company", "two years later" refer to it); a chunk that does not
follow its antecedent reads its anchored entry. The same `chunk_view` reads it: the anchor is longer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hypic_rag.entry.schema import SEAM_TOKENS, TOKEN_IDS, Entry, check_seam_tokens, entry_tensor_bytes, is_kv_name

MAX_ANCHOR_TOKENS = 32
"""The anchor is the prompt prefix's last (at most) this many tokens: a long system prompt would otherwise be
encoded again, and stored, with every chunk. On the stage-3 test bed (an 8-token prefix) its last 4 tokens were
nearly as good as all 8 (mean KL 0.005 against 0.002), its first 4 no better than no anchor."""

EntryKey = tuple[int, tuple[int, ...]]
"""Where an entry is kept: (entry seam, the encoded segment's token ids)."""


def anchor_of(prefix_ids: Sequence[int]) -> list[int]:
    """The anchor of a request whose prompt prefix is `prefix_ids` [P]: its last `MAX_ANCHOR_TOKENS` tokens."""
    return [int(token) for token in prefix_ids[-MAX_ANCHOR_TOKENS:]] if len(prefix_ids) else []


def anchored_key(anchor: Sequence[int], chunk_ids: Sequence[int], seam_tokens: int) -> EntryKey:
    """The key of a chunk's anchored entry for seam `seam_tokens`: the segment `anchor + chunk` at seam
    `len(anchor) + seam_tokens` (the plain key when the anchor is empty)."""
    check_seam_tokens(seam_tokens)
    return len(anchor) + seam_tokens, tuple(int(token) for token in anchor) + tuple(int(token) for token in chunk_ids)


def chained_anchor(anchor: Sequence[int], antecedent_ids: Sequence[int]) -> list[int]:
    """What a chained entry is encoded after: the request's anchor [A] and the chunk [L'] that precedes the chunk
    in its document (and in the prompt). A chunk right after the prefix's anchor and its antecedent composes from
    it exactly as `full` computes it."""
    return [int(token) for token in anchor] + [int(token) for token in antecedent_ids]


def chunk_view(entry: Entry, anchor_length: int, seam_tokens: int) -> Entry:
    """The chunk's entry for seam `seam_tokens` inside the entry of `anchor + chunk` at seam
    `anchor_length + seam_tokens`: K/V rows past the anchor ([H_kv, L, D] views), the chunk's token ids, the linear
    tensors as they are. ValueError when `entry` was not encoded for that seam or holds no chunk tokens."""
    stored_seam = int(entry[SEAM_TOKENS])
    if stored_seam != anchor_length + seam_tokens:
        raise ValueError(f"an anchored entry for seam {seam_tokens} after {anchor_length} anchor tokens must be "
                         f"encoded for seam {anchor_length + seam_tokens}, got {stored_seam}")
    if int(entry[TOKEN_IDS].shape[0]) <= anchor_length:
        raise ValueError("an anchored entry must hold chunk tokens after its anchor")
    if anchor_length == 0:
        return entry
    view: Entry = {name: tensor[:, anchor_length:] if is_kv_name(name) else tensor for name, tensor in entry.items()}
    view[TOKEN_IDS] = entry[TOKEN_IDS][anchor_length:]
    view[SEAM_TOKENS] = torch.tensor(seam_tokens, dtype=entry[SEAM_TOKENS].dtype)
    return view


def anchored_extra_bytes(entry: Entry, anchor_length: int) -> int:
    """Bytes an anchored entry holds beyond the chunk's own: the anchor's K/V rows and token ids."""
    view = chunk_view(entry, anchor_length, int(entry[SEAM_TOKENS]) - anchor_length)
    return entry_tensor_bytes(entry) - entry_tensor_bytes(view)
