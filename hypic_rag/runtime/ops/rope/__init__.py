"""Rotary position embedding for cached keys re-positioned at assembly (docs/design.md, section 3).

`naive.py` holds the rotation (`apply_rotary`) and the float32 reference of rotating keys into the K buffer;
the fast path is the Triton kernel `hypic_rag.kernels.rope.rope_into`; `dispatch.py` picks one per call.
"""

from hypic_rag.runtime.ops.rope.dispatch import rotate_into
from hypic_rag.runtime.ops.rope.naive import apply_rotary, naive_rope_into

__all__ = ["apply_rotary", "naive_rope_into", "rotate_into"]
