"""Retrieval: load a corpus, chunk it with the model's tokenizer, embed, index with FAISS, precompute the cache.

See docs/retrieval.md. Modules are imported directly (`hypic_rag.retrieval.corpus_index`, `...precompute`);
nothing is imported here, so that loading one part never pulls in torch, FAISS or sentence-transformers.
"""
