"""Batches of texts to padded token ids with the `tokenizers` library alone (no transformers import).

`BatchTokenizer` does what transformers' tokenizer does for `tokenizer(texts, padding=True,
truncation="longest_first", max_length=limit)` on a BERT directory's tokenizer.json: special tokens added,
truncation to `limit` tokens counting them, right side; padding on the right to the batch's longest with the
pad token named in tokenizer_config.json. tokenizer.json carries truncation and padding settings of its own (the
MiniLM one: truncate to 128, pad to a fixed 128); both are replaced here, as transformers replaces them for
every call. Equal ids and masks to transformers' tokenizer: tests/retrieval/test_embeddings.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hypic_rag.runtime.checkpoints.files import read_json
from hypic_rag.runtime.checkpoints.tokenizer import special_token_text

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_SETTINGS_FILE = "tokenizer_config.json"
BERT_TOKENIZER_CLASSES = ("BertTokenizer", "BertTokenizerFast")


class BatchTokenizer:
    """tokenizer.json of a BERT directory, set to truncate to `max_length` tokens and pad each batch to its
    longest."""

    def __init__(self, tokenizer: Any, max_length: int, pad_token: str, pad_id: int) -> None:
        if max_length < 2:
            raise ValueError(f"max_length must leave room for the two special tokens, got {max_length}")
        self.tokenizer = tokenizer
        self.max_length = max_length
        tokenizer.enable_truncation(max_length=max_length, stride=0, strategy="longest_first", direction="right")
        tokenizer.enable_padding(direction="right", pad_id=pad_id, pad_type_id=0, pad_token=pad_token, length=None,
                                 pad_to_multiple_of=None)
        tokenizer.encode_special_tokens = False

    @classmethod
    def read(cls, model_dir: Path, max_length: int) -> BatchTokenizer | None:
        """The tokenizer of `model_dir` when it has a tokenizer.json that transformers would load as a BERT tokenizer
        as it is (right-side padding and truncation, special tokens not split, its pad token in the vocabulary);
        None otherwise (the caller then uses transformers' tokenizer)."""
        tokenizer_file, settings_file = model_dir / TOKENIZER_FILE, model_dir / TOKENIZER_SETTINGS_FILE
        if not (tokenizer_file.is_file() and settings_file.is_file()):
            return None
        try:
            settings = read_json(settings_file)
            described = read_json(tokenizer_file)
        except (OSError, ValueError):
            return None
        if not isinstance(settings, dict) or settings.get("tokenizer_class") not in (None, *BERT_TOKENIZER_CLASSES):
            return None
        if settings.get("padding_side", "right") != "right" or settings.get("truncation_side", "right") != "right":
            return None
        if settings.get("split_special_tokens"):
            return None
        normalizer = described.get("normalizer") or {}
        if ("do_lower_case" in settings and normalizer.get("type") == "BertNormalizer"
                and bool(settings["do_lower_case"]) != bool(normalizer.get("lowercase"))):
            return None
        pad_token = special_token_text(settings.get("pad_token"))
        if pad_token is None:
            return None
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        for number, token in (settings.get("added_tokens_decoder") or {}).items():
            if tokenizer.token_to_id(special_token_text(token) or "") != int(number):
                return None  # transformers would add or renumber tokens
        pad_id = tokenizer.token_to_id(pad_token)
        if pad_id is None:
            return None
        return cls(tokenizer, max_length, pad_token, pad_id)

    def __call__(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [len(texts), tokens] int64 and attention_mask [len(texts), tokens] int64 (1: a real token),
        tokens being the longest text's count after truncation."""
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=True)
        input_ids = torch.tensor([encoding.ids for encoding in encodings], dtype=torch.long)
        attention_mask = torch.tensor([encoding.attention_mask for encoding in encodings], dtype=torch.long)
        return input_ids, attention_mask
