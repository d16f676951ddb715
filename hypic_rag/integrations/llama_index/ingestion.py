"""`HypicCacheTransformation`: an ingestion step that encodes every node's segment-cache entry ahead of queries."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.schema import BaseNode, MetadataMode, TransformComponent

from hypic_rag.integrations.llama_index.layout import document_order
from hypic_rag.integrations.llama_index.runtime import DEFAULT_SEAM_TOKENS, HypicRuntime, runtime_for
from hypic_rag.retrieval.chunk_context import chunk_contexts
from hypic_rag.runtime.engine import PrefillStats

logger = logging.getLogger(__name__)

__all__ = ["HypicCacheTransformation"]


class HypicCacheTransformation(TransformComponent):
    """An `IngestionPipeline` step that encodes every node's segment-cache entry ahead of queries.

    Place it after the node parser (and before the embed model). Each node's text (metadata left out) is formatted
    as a retrieved-chunk segment, exactly as `HypicQueryEngine` lays it out, so queries find its entry; the prompt
    prefix is encoded too. Each node's text becomes a known chunk of the runtime, so a `HypicLLM` finds it in the
    plain prompts LlamaIndex's own engines send and reuses its entry (`hypic_rag.prompting.matching`). Nodes pass
    through unchanged but for `metadata[metadata_key]` (the segment's token count), hidden from embeddings and the
    LLM, and, under `embedding_context` (`hypic_rag.retrieval.chunk_context`, as an index's chunks are embedded;
    default `document_head`), `metadata[context_key]`: the node's document context (for `document_head`, the
    document's first sentence on every node after the document's first; for `previous_tail`, the previous node's
    last sentence), which LlamaIndex's embedding text includes and the LLM's text and the cached segment do not.
    LlamaIndex already embeds a node's other metadata (a title, a section), so only the sentence is added.
    """

    model_path: str | None = Field(default=None, description="Checkpoint directory; None: the bundled default model.")
    cache_dir: str | None = Field(default=None, description="Segment cache directory; None: the in-memory cache.")
    seam_tokens: int = Field(default=DEFAULT_SEAM_TOKENS, ge=0, description="Seam window the entries are made for.")
    device: str | None = Field(default=None, description="cpu or cuda (None: cuda when available).")
    metadata_key: str = Field(default="hypic_segment_tokens", description="Node metadata key of the token count.")
    embedding_context: str = Field(default="document_head",
                                   description="none, document_head or previous_tail: what a node is embedded with.")
    context_key: str = Field(default="document_context", description="Node metadata key of its document context.")
    _runtime: HypicRuntime = PrivateAttr()
    _last_stats: PrefillStats | None = PrivateAttr(default=None)

    def __init__(self, *, runtime: HypicRuntime | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.embedding_context not in ("none", "document_head", "previous_tail"):
            raise ValueError(f"embedding_context must be none, document_head or previous_tail, got "
                             f"{self.embedding_context!r}")
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
        self._add_contexts(nodes)
        began = time.perf_counter()
        self._last_stats = self._runtime.precompute(segments, include_prefix=True)
        self._runtime.know_chunks(texts)
        logger.info(
            "segment cache: %d nodes and the prompt prefix, %d already cached, %d encoded in %.2f s",
            len(segments), self._last_stats.cache_hits, self._last_stats.cache_misses, time.perf_counter() - began,
        )
        return nodes

    def _add_contexts(self, nodes: Sequence[BaseNode]) -> None:
        """Set each node's `context_key` metadata to its document context (`chunk_context.chunk_contexts` over its
        document's nodes in document order, `layout.document_order`); a document whose first node in order is not
        its first node (a PREVIOUS relationship) gets none from `document_head`."""
        if self.embedding_context == "none":
            return
        for group in _by_document(document_order(nodes)):
            text = group[0].get_content(metadata_mode=MetadataMode.NONE) if group[0].prev_node is None else ""
            chunks = [SimpleNamespace(text=node.get_content(metadata_mode=MetadataMode.NONE), metadata={})
                      for node in group]
            contexts = chunk_contexts(SimpleNamespace(text=text, metadata={}), chunks, self.embedding_context)
            for node, context in zip(group, contexts):
                node.metadata.pop(self.context_key, None)
                if context:
                    node.metadata[self.context_key] = context
                    if self.context_key not in node.excluded_llm_metadata_keys:
                        node.excluded_llm_metadata_keys.append(self.context_key)


def _by_document(nodes: Sequence[BaseNode]) -> list[list[BaseNode]]:
    """Nodes (in document order, `document_order`) cut into their source documents' runs."""
    groups: dict[str, list[BaseNode]] = {}
    for node in nodes:
        groups.setdefault(node.ref_doc_id or node.node_id, []).append(node)
    return list(groups.values())
