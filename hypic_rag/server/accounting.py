"""Token accounting of one generation, as the service and the integrations report it."""

from __future__ import annotations

from hypic_rag.runtime.engine import Generation


def usage_of(generation: Generation) -> dict[str, int]:
    """Prompt tokens, those served from cached entries (prefix checkpoints included), those recomputed, completion
    tokens, and the segments found in (`cache_hits`) or encoded into (`cache_misses`) the cache."""
    prefill = generation.prefill
    return {
        "prompt_tokens": prefill.prompt_tokens,
        "cached_tokens": prefill.cached_tokens + prefill.prefix_reused_tokens,
        "recomputed_tokens": prefill.recomputed_tokens,
        "completion_tokens": len(generation.token_ids),
        "cache_hits": prefill.cache_hits,
        "cache_misses": prefill.cache_misses,
    }
