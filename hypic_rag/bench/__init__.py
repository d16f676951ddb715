"""Benchmarks: all six modes side by side in one run (`hypic-rag bench`)."""
