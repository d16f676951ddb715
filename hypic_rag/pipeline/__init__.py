"""The RAG pipeline: one loaded model in use and what is built on it, below the ways in (CLI, service, integrations).

- `session`: `ModelSession`, one loaded model with its engine, segment source and prompt format, built once;
- `answering`: `RagPipeline`, question answering over an index (retrieve, assemble cached segments, generate);
- `precompute`: `build_index`, an index of a corpus with every chunk encoded into the segment cache;
- `usage`, `vocabulary`: the token accounting and the field names every surface reports the same way.
"""
