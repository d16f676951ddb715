"""Sampling: `SamplingParams` and how the next token is chosen from the logits.

Greedy at temperature 0; otherwise softmax over float64 logits shifted so the top one is exactly 0 (no inf - inf
or 0 / 0 at any temperature), restricted to the nucleus `top_p`, drawn with a per-generation CPU generator that a
seed makes reproducible and that otherwise draws fresh randomness from the operating system.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

SEED_MAX = 2**64 - 1
"""Seeds are unsigned 64-bit integers (what `torch.Generator.manual_seed` takes without wrapping)."""


@dataclass(slots=True)
class SamplingParams:
    """temperature 0 means greedy (finite, >= 0; a temperature so small that only the top token keeps any
    probability samples greedily); top_p in (0, 1]; seed in [0, 2**64 - 1] makes sampling reproducible, and
    without one every generation draws fresh randomness."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            integral = isinstance(self.seed, numbers.Integral) and not isinstance(self.seed, bool)
            if not integral or not 0 <= self.seed <= SEED_MAX:
                raise ValueError(f"seed must be an integer in [0, 2**64 - 1], got {self.seed!r}")
            self.seed = int(self.seed)


def sampling_generator(seed: int | None) -> torch.Generator:
    """The CPU generator of one generation: seeded (reproducible) or, without a seed, seeded from the operating
    system's entropy so that every unseeded generation draws fresh randomness."""
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sampling_probabilities(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Next-token probabilities [vocab] (float64) of `logits` [vocab] at `temperature` > 0 under nucleus `top_p`.

    Logits are shifted so the largest is exactly 0 before scaling, and the top ones stay 0 whatever the
    temperature: a temperature so small that every other logit scales to -inf leaves the top token(s) alone,
    so no inf - inf or 0 / 0 can make a NaN and sampling is greedy (up to exact ties). The top token always
    stays in the nucleus, which is renormalised.
    """
    shifted = logits.detach().to("cpu", torch.float64)
    shifted = shifted - shifted.max()
    scaled = torch.where(shifted == 0, torch.zeros_like(shifted), shifted / temperature)
    probabilities = torch.softmax(scaled, dim=-1)
    if top_p < 1:
        sorted_probabilities, order = torch.sort(probabilities, descending=True)
        keep = sorted_probabilities.cumsum(-1) - sorted_probabilities < top_p
        keep[0] = True
        kept = sorted_probabilities * keep
        probabilities = torch.zeros_like(probabilities).scatter(0, order, kept / kept.sum())
    return probabilities


def choose_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """The next token id for `logits` [vocab]: argmax at temperature 0, else drawn with `generator`."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    probabilities = sampling_probabilities(logits, params.temperature, params.top_p)
    return int(torch.multinomial(probabilities, 1, generator=generator))
