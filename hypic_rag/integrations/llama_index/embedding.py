"""`HypicEmbedding`: the shipped sentence-transformers model as a LlamaIndex embed model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import Field, PrivateAttr

__all__ = ["HypicEmbedding"]


class HypicEmbedding(BaseEmbedding):
    """The shipped all-MiniLM-L6-v2 sentence-transformers model (or any local one) as a LlamaIndex embed model.

    Offline: nothing is downloaded. Vectors are L2-normalised (inner product is cosine similarity).
    """

    model_path: str | None = Field(
        default=None, description="A local sentence-transformers directory; None: the shipped all-MiniLM-L6-v2."
    )
    _embedder: Any = PrivateAttr()

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
        return self._embedder.embed_query(query).tolist()

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._embedder.embed([text])[0].tolist()

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._embedder.embed(texts).tolist()
