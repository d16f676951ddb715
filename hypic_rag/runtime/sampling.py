"""Sampling: `SamplingParams` and how the next token is chosen from the logits.

The logits are first adjusted as OpenAI's parameters say (`adjusted_logits`): `logit_bias` added per token id,
then `frequency_penalty` times each token's count in the generated text and `presence_penalty` once for each token
that appears in it subtracted. Greedy (the adjusted argmax) at temperature 0; otherwise softmax over float64 logits
shifted so the top one is exactly 0 (no inf - inf or 0 / 0 at any temperature), restricted to the `top_k` most
likely tokens and then to the nucleus `top_p`, drawn with a per-generation CPU generator that a seed makes
reproducible and that otherwise draws fresh randomness from the operating system. `token_logprobs` gives the
log-probabilities OpenAI's `logprobs` reports: of the model's raw distribution, before any adjustment.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

SEED_MAX = 2**64 - 1
"""Seeds are unsigned 64-bit integers (what `torch.Generator.manual_seed` takes without wrapping)."""


@dataclass(slots=True)
class SamplingParams:
    """temperature 0 means greedy (finite, >= 0; a temperature so small that only the top token keeps any
    probability samples greedily); top_p in (0, 1]; top_k keeps the k most likely tokens (0: all); seed in
    [0, 2**64 - 1] makes sampling reproducible, and without one every generation draws fresh randomness.
    presence_penalty / frequency_penalty (finite, OpenAI's -2..2 is checked by the service) and logit_bias
    (token id -> finite bias) adjust the logits before choosing, greedy included. logprobs: how many of the most
    likely alternatives to report per generated token (None: no log-probabilities at all; 0: the chosen token's)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    logprobs: int | None = None

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
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no limit), got {self.top_k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)!r}")
        if any(not math.isfinite(bias) or token < 0 for token, bias in self.logit_bias.items()):
            raise ValueError("logit_bias maps token ids (>= 0) to finite numbers")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs!r}")

    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties or a logit bias change the logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


def sampling_generator(seed: int | None) -> torch.Generator:
    """The CPU generator of one generation: seeded (reproducible) or, without a seed, seeded from the operating
    system's entropy so that every unseeded generation draws fresh randomness."""
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def adjusted_logits(logits: torch.Tensor, params: SamplingParams, generated: Sequence[int]) -> torch.Tensor:
    """`logits` [vocab] as OpenAI's parameters adjust them (float64, CPU): `logit_bias[t]` added to token t, then
    `frequency_penalty * count(t) + presence_penalty * (count(t) > 0)` subtracted, counting t in `generated` (the
    tokens generated so far, not the prompt's, as OpenAI and vLLM do). Unchanged when nothing adjusts them.
    ValueError for a biased token id outside the vocabulary."""
    adjusted = logits.detach().to("cpu", torch.float64)
    if not params.adjusts_logits:
        return adjusted
    adjusted = adjusted.clone()
    vocab = adjusted.shape[-1]
    for token, bias in params.logit_bias.items():
        if not 0 <= token < vocab:
            raise ValueError(f"logit_bias: token id {token} is outside the vocabulary (0..{vocab - 1})")
        adjusted[token] += bias
    if generated and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(list(generated), dtype=torch.int64), minlength=vocab)[:vocab]
        counts = counts.to(torch.float64)
        adjusted -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(torch.float64)
    return adjusted


def sampling_probabilities(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0) -> torch.Tensor:
    """Next-token probabilities [vocab] (float64) of `logits` [vocab] at `temperature` > 0, restricted to the
    `top_k` most likely tokens (0: all) and then to the nucleus `top_p`.

    Logits are shifted so the largest is exactly 0 before scaling, and the top ones stay 0 whatever the
    temperature: a temperature so small that every other logit scales to -inf leaves the top token(s) alone,
    so no inf - inf or 0 / 0 can make a NaN and sampling is greedy (up to exact ties). The top token always
    stays in the nucleus, which is renormalised.
    """
    shifted = logits.detach().to("cpu", torch.float64)
    shifted = shifted - shifted.max()
    scaled = torch.where(shifted == 0, torch.zeros_like(shifted), shifted / temperature)
    probabilities = torch.softmax(scaled, dim=-1)
    if 0 < top_k < probabilities.shape[-1]:
        kept_ids = torch.topk(probabilities, top_k, sorted=False).indices
        mask = torch.zeros_like(probabilities).scatter(0, kept_ids, 1.0)
        probabilities = probabilities * mask
        probabilities = probabilities / probabilities.sum()
    if top_p < 1:
        sorted_probabilities, order = torch.sort(probabilities, descending=True)
        keep = sorted_probabilities.cumsum(-1) - sorted_probabilities < top_p
        keep[0] = True
        kept = sorted_probabilities * keep
        probabilities = torch.zeros_like(probabilities).scatter(0, order, kept / kept.sum())
    return probabilities


def choose_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, generated: Sequence[int] = ()
) -> int:
    """The next token id for `logits` [vocab] after `generated` (the tokens generated so far, for the penalties):
    the argmax of the adjusted logits at temperature 0, else drawn with `generator`."""
    if params.adjusts_logits:
        logits = adjusted_logits(logits, params, generated)
    if params.temperature == 0:
        return int(torch.argmax(logits))
    probabilities = sampling_probabilities(logits, params.temperature, params.top_p, params.top_k)
    return int(torch.multinomial(probabilities, 1, generator=generator))


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log-probability and the `top` most likely tokens' [(token id, log-probability)],
    best first, under the model's raw distribution (before penalties, bias, temperature and truncation)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, token_id: int, top: int) -> TokenLogprob:
    """`TokenLogprob` of `token_id` under `logits` [vocab] with the `top` most likely alternatives."""
    logprobs = torch.log_softmax(logits.detach().to("cpu", torch.float64), dim=-1)
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]))
        best = tuple((int(i), float(v)) for i, v in zip(ids, values))
    return TokenLogprob(int(token_id), float(logprobs[token_id]), best)
