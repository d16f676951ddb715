"""The conv tail carried across spans: the last kernel-1 pre-conv inputs a short causal conv needs before a span's
first token (docs/design.md, section 2: "cache each chunk's conv tail").

`naive.py` is the float32 reference (concatenate and cut); the fast paths are the torch step (`step.py`:
`advance_tail_cached`, what the single-request stack does per cached remainder) and the batched Triton kernel
`hypic_rag.kernels.conv_tail`; `stitch_conv_tails` runs the one `ops/registry.py` picks.
"""

from collections.abc import Sequence

import torch

from hypic_rag.runtime.ops.conv_tail.naive import naive_stitch_conv_tails
from hypic_rag.runtime.ops.conv_tail.step import advance_tail_cached
from hypic_rag.runtime.ops.registry import dispatch


@dispatch("stitch_conv_tails")
def stitch_conv_tails(
    start: torch.Tensor | None, tails: torch.Tensor, lengths: Sequence[int] | torch.Tensor, counts: Sequence[int], *,
    store_steps: bool = False, backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Contract of `naive_stitch_conv_tails`: start [N, C, W] or None, tails [M, C, W], lengths [M], counts [N];
    returns end tails [N, C, W] (and the tail after every span [M, C, W]), float32. `backend` ("triton" / "torch")
    overrides the switch."""


__all__ = ["advance_tail_cached", "naive_stitch_conv_tails", "stitch_conv_tails"]
