"""`HypicCacheTransformation`: an ingestion step that encodes every node's segment-cache entry ahead of queries."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.schema import BaseNode, MetadataMode, TransformComponent

from hypic_rag.integrations.llama_index.runtime import DEFAULT_SEAM_TOKENS, HypicRuntime, runtime_for
from hypic_rag.runtime.engine import PrefillStats

logger = logging.getLogger(__name__)

__all__ = ["HypicCacheTransformation"]


class HypicCacheTransformation(TransformComponent):
    """An `IngestionPipeline` step that encodes every node's segment-cache entry ahead of queries.

    Place it after the node parser. Each node's text (metadata left out) is formatted as a retrieved-chunk
    segment, exactly as `HypicQueryEngine` lays it out, so queries find its entry; the prompt prefix is encoded
    too. Each node's text becomes a known chunk of the runtime, so a `HypicLLM` finds it in the plain prompts
    LlamaIndex's own engines send and reuses its entry (`hypic_rag.prompting.matching`). Nodes pass through unchanged
    but for `metadata[metadata_key]` (the segment's token count), hidden from embeddings and the LLM.
    """

    model_path: str | None = Field(default=None, description="Checkpoint directory; None: the bundled default model.")
    cache_dir: str | None = Field(default=None, description="Segment cache directory; None: the in-memory cache.")
    seam_tokens: int = Field(default=DEFAULT_SEAM_TOKENS, ge=0, description="Seam window the entries are made for.")
    device: str | None = Field(default=None, description="cpu or cuda (None: cuda when available).")
    metadata_key: str = Field(default="hypic_segment_tokens", description="Node metadata key of the token count.")
    _runtime: HypicRuntime = PrivateAttr()
    _last_stats: PrefillStats | None = PrivateAttr(default=None)

    def __init__(self, *, runtime: HypicRuntime | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._runtime = runtime_for(runtime, self.model_path, self.cache_dir, self.seam_tokens, self.device)

    @classmethod
    def class_name(cls) -> str:
        return "HypicCacheTransformation"

    @property
    def runtime(self) -> HypicRuntime:
        return self._runtime

    @property
    def last_stats(self) -> PrefillStats | None:
        """Segments of the last call (its nodes and the prompt prefix) already cached (hits) or encoded (misses)."""
        return self._last_stats

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        segments, texts = [], []
        for node in nodes:
            texts.append(node.get_content(metadata_mode=MetadataMode.NONE))
            ids = self._runtime.chunk_ids(texts[-1])
            segments.append(ids)
            node.metadata[self.metadata_key] = len(ids)
            for excluded in (node.excluded_embed_metadata_keys, node.excluded_llm_metadata_keys):
                if self.metadata_key not in excluded:
                    excluded.append(self.metadata_key)
        began = time.perf_counter()
        self._last_stats = self._runtime.precompute(segments, include_prefix=True)
        self._runtime.know_chunks(texts)
        logger.info(
            "segment cache: %d nodes and the prompt prefix, %d already cached, %d encoded in %.2f s",
            len(segments), self._last_stats.cache_hits, self._last_stats.cache_misses, time.perf_counter() - began,
        )
        return nodes
