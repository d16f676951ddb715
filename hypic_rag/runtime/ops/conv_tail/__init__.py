"""The conv tail carried across spans: the last kernel-1 pre-conv inputs a short causal conv needs before a span's
first token (docs/design.md, section 2: "cache each chunk's conv tail").

`naive.py` is the float32 reference (concatenate and cut); the fast paths are the torch step
(`advance_tail_cached`) and the batched Triton kernel `hypic_rag.kernels.conv_tail`; `dispatch.py` picks one.
"""

from hypic_rag.runtime.ops.conv_tail.dispatch import advance_tail_cached, stitch_conv_tails
from hypic_rag.runtime.ops.conv_tail.naive import naive_stitch_conv_tails

__all__ = ["advance_tail_cached", "naive_stitch_conv_tails", "stitch_conv_tails"]
