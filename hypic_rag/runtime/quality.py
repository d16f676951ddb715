"""Deviation of a mode's next-token distribution from `full`."""

from __future__ import annotations

import torch


def kl_divergence(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(reference || other) of the softmax distributions over the last dim (logits [..., vocab]), averaged."""
    reference = torch.log_softmax(reference_logits.double(), dim=-1)
    other = torch.log_softmax(logits.double(), dim=-1)
    return float((reference.exp() * (reference - other)).sum(-1).mean())
