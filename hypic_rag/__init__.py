"""hypic-rag: position-independent caching for hybrid-attention LLMs."""

__version__ = "0.1.0"
