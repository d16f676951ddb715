"""Synthetic data: a deterministic multi-document QA corpus of fictional entities (see `synthetic_qa`)."""
