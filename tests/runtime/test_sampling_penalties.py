"""OpenAI's sampling parameters in `runtime.sampling`, checked against a direct computation of their definitions."""

from __future__ import annotations

import math

import pytest
import torch

from hypic_rag.runtime.sampling import (
    SamplingParams,
    adjusted_logits,
    choose_token,
    sampling_generator,
    sampling_probabilities,
    token_logprobs,
)

LOGITS = torch.tensor([2.0, 1.5, 0.5, -1.0, 0.0, 3.0])


def test_penalties_and_bias_follow_openais_definition() -> None:
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=0.3, logit_bias={2: 5.0, 3: -1.5})
    generated = [5, 5, 1, 5, 0]
    adjusted = adjusted_logits(LOGITS, params, generated)
    for token in range(len(LOGITS)):
        count = generated.count(token)
        expected = LOGITS[token].item() + {2: 5.0, 3: -1.5}.get(token, 0.0) - 0.3 * count - 0.7 * (count > 0)
        assert adjusted[token].item() == pytest.approx(expected, abs=1e-12)
    assert adjusted.dtype == torch.float64


def test_greedy_follows_the_adjusted_logits() -> None:
    assert choose_token(LOGITS, SamplingParams(), sampling_generator(0)) == 5
    biased = SamplingParams(logit_bias={2: 10.0})
    assert choose_token(LOGITS, biased, sampling_generator(0)) == 2
    penalised = SamplingParams(frequency_penalty=2.0)
    assert choose_token(LOGITS, penalised, sampling_generator(0), [5]) == 0  # 3 - 2 = 1 < 2
    assert choose_token(LOGITS, SamplingParams(presence_penalty=-2.0), sampling_generator(0), [1]) == 1


def test_top_k_keeps_the_k_most_likely_then_renormalises() -> None:
    probabilities = sampling_probabilities(LOGITS, 1.0, 1.0, top_k=2)
    weights = {5: math.exp(3.0), 0: math.exp(2.0)}
    total = sum(weights.values())
    for token in range(len(LOGITS)):
        assert probabilities[token].item() == pytest.approx(weights.get(token, 0.0) / total, abs=1e-12)
    draws = {choose_token(LOGITS, SamplingParams(temperature=5.0, top_k=2), sampling_generator(seed))
             for seed in range(40)}
    assert draws == {0, 5}


def test_top_k_then_top_p() -> None:
    probabilities = sampling_probabilities(LOGITS, 1.0, 0.5, top_k=3)
    assert probabilities.nonzero().flatten().tolist() == [5]  # exp(3)/(e^3+e^2+e^1.5) = 0.63 > 0.5


def test_token_logprobs_are_the_raw_log_softmax() -> None:
    reference = torch.log_softmax(LOGITS.double(), dim=-1)
    item = token_logprobs(LOGITS, 2, top=3)
    assert item.token_id == 2 and item.logprob == pytest.approx(reference[2].item())
    assert [token for token, _ in item.top] == [5, 0, 1]
    assert [value for _, value in item.top] == pytest.approx([reference[i].item() for i in (5, 0, 1)])
    assert token_logprobs(LOGITS, 2, top=0).top == ()


@pytest.mark.parametrize("options", [{"top_k": -1}, {"presence_penalty": math.inf}, {"logit_bias": {1: math.nan}},
                                     {"logit_bias": {-1: 1.0}}, {"logprobs": -1}])
def test_invalid_parameters_are_refused(options: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**options)


def test_bias_outside_the_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        adjusted_logits(LOGITS, SamplingParams(logit_bias={6: 1.0}), [])
