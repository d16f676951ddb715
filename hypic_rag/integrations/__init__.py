"""Integrations with other frameworks. Each is imported on first use, so its framework stays optional:

    from hypic_rag.integrations.llama_index import HypicLLM, HypicQueryEngine   # needs llama-index-core 0.14
"""

from __future__ import annotations

import importlib
from typing import Any

_LLAMA_INDEX_NAMES = frozenset(
    {
        "HypicCacheTransformation", "HypicCondensePlusContextChatEngine", "HypicContextChatEngine", "HypicEmbedding",
        "HypicLLM", "HypicQueryEngine", "HypicRuntime", "HypicSynthesizer",
    }
)


def __getattr__(name: str) -> Any:
    if name in _LLAMA_INDEX_NAMES:
        return getattr(importlib.import_module("hypic_rag.integrations.llama_index"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
