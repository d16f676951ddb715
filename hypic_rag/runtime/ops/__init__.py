"""Sequence-mixing operators in plain torch (float32 references and chunked fast paths)."""
