"""Falcon-H1's two mixers (docs/families_ssm.md, section 4): the Mamba2 / SSD mixer with muP multipliers and an
optional gated norm, and attention whose keys are scaled by `key_multiplier`.

- `FalconH1Mamba2Mixer`: `in_proj(u) * mup_vector` (the module's non-persistent buffer, rebuilt from the config:
  the slices z | x | B | C | dt times `ssm_multipliers[0..4]`), so the conv tail holds the multiplied pre-conv
  inputs; the block feeds u = `ssm_in_multiplier` * x (a `Branch` input multiplier). Output: `norm(y, z)` when
  `mamba_rms_norm` (`FalconH1RMSNormGated`, groups of `mamba_n_groups`, normalise-then-gate or gate-then-normalise
  by `mamba_norm_before_gate`), else `y * silu(z)`; then `out_proj` (bias = `projectors_bias`).
- `KeyScaledAttention`: `ProjectedAttention` with k = k_proj(x) * key_multiplier (cached keys hold the product; RoPE
  is linear, so scaling before or after the rotation is the same).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hypic_rag.runtime.mixers.attention import ProjectedAttention
from hypic_rag.runtime.mixers.base import AttentionProjections, Projections
from hypic_rag.runtime.mixers.ssd import Mamba2Mixer


class FalconH1Mamba2Mixer(Mamba2Mixer):
    """`Mamba2Mixer` over a `FalconH1Mixer` (same attributes plus `mup_vector` [1, 1, 2I + 2GN + H],
    `mamba_rms_norm`)."""

    def project(self, x: torch.Tensor) -> Projections:
        module = self.module
        projected = module.in_proj(x) * module.mup_vector.reshape(-1).to(x.dtype)
        gate, conv_input, raw_time_step = projected.split(
            [module.intermediate_size, module.conv_dim, module.num_heads], dim=-1
        )
        return Projections(conv_input, (gate, raw_time_step))

    def output(self, core: torch.Tensor, projections: Projections, dtype: torch.dtype) -> torch.Tensor:
        """Gated norm (or plain gate) and output projection: core [..., T, H, P] -> [..., T, hidden]."""
        gate = projections.extras[0]
        scan_output = core.reshape(*core.shape[:-2], -1)
        if self.module.mamba_rms_norm:
            gated = self.module.norm(scan_output, gate)
        else:
            gated = scan_output * F.silu(gate.float())
        return self.module.out_proj(gated.to(dtype))


class KeyScaledAttention(ProjectedAttention):
    """q/k/v/o attention whose keys are multiplied by the module's `key_multiplier` (Falcon-H1)."""

    def project(self, x: torch.Tensor) -> AttentionProjections:
        projections = super().project(x)
        projections.key = projections.key * self.module.key_multiplier
        return projections
