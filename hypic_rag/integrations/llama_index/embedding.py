"""`HypicEmbedding`: the shipped sentence-transformers model as a LlamaIndex embed model."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import Field, PrivateAttr

from hypic_rag.integrations.llama_index.aio import in_thread

__all__ = ["HypicEmbedding"]


class HypicEmbedding(BaseEmbedding):
    """The shipped all-MiniLM-L6-v2 sentence-transformers model (or any local one) as a LlamaIndex embed model.

    Offline: nothing is downloaded. Vectors are L2-normalised (inner product is cosine similarity). The async
    methods embed in a worker thread (the event loop keeps running); one lock serialises use of the model.
    """

    model_path: str | None = Field(
        default=None, description="A local sentence-transformers directory; None: the shipped all-MiniLM-L6-v2."
    )
    _embedder: Any = PrivateAttr()
    _lock: Any = PrivateAttr(default_factory=threading.Lock)

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        from hypic_rag.retrieval.embeddings import DEFAULT_EMBEDDER_NAME, SentenceEmbedder

        embedder = SentenceEmbedder(model_path)
        kwargs.setdefault("model_name", DEFAULT_EMBEDDER_NAME if model_path is None else Path(model_path).name)
        super().__init__(model_path=model_path, **kwargs)
        self._embedder = embedder

    @classmethod
    def class_name(cls) -> str:
        return "HypicEmbedding"

    def _get_query_embedding(self, query: str) -> list[float]:
        with self._lock:
            return self._embedder.embed_query(query).tolist()

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return await in_thread(self._get_query_embedding, query)

    def _get_text_embedding(self, text: str) -> list[float]:
        with self._lock:
            return self._embedder.embed([text])[0].tolist()

    async def _aget_text_embedding(self, text: str) -> list[float]:
        return await in_thread(self._get_text_embedding, text)

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        with self._lock:
            return self._embedder.embed(texts).tolist()

    async def _aget_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return await in_thread(self._get_text_embeddings, texts)
