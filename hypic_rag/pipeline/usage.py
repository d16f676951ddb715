"""Token accounting of one generation, as the service and the integrations report it."""

from __future__ import annotations

from hypic_rag.runtime.generation import Generation


def usage_of(generation: Generation) -> dict[str, int]:
    """Prompt tokens: those reused from before the request (`cached_tokens`: cache hits, prefix checkpoints),
    those served from entries encoded during it (`encoded_tokens`) and those recomputed (the three add up to
    `prompt_tokens`); completion tokens; the segments found in (`cache_hits`) or encoded into (`cache_misses`)
    the cache. See `Generation.usage`."""
    return generation.usage()
