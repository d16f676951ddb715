"""What every hybrid family must satisfy on tiny random fp32 models (docs/runtime.md, "Mixers"), as plain functions
test_every_family.py runs over every family's tiny models (and per-family files call on models of their own):
- `full` equals transformers' own forward (logits within 1e-4) and its 16 greedy tokens;
- `hypic` with a seam covering every chunk equals `full` (1e-4), `prefix` equals `full` (1e-5);
- a one-layer, linear-only model (conv kernel 1) composes any chunks exactly in `transition` (1e-5);
- the mean KL(full || mode) over 20 random requests is ordered hypic < transition_rope < addition (NoPE: with
  re-positioning a no-op, transition_rope == transition).
"""

from __future__ import annotations

import torch

from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.model import wrap_model
from hypic_rag.runtime.quality import kl_divergence
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.testing import build_tiny_model
from kits.corpora import random_request


def tiny_engine(model_type: str, **options) -> tuple[torch.nn.Module, Engine]:
    """The family's tiny random model (`build_tiny_model(model_type, seed=3, **options)`) and an engine over it with
    a seam of 4."""
    hf_model = build_tiny_model(model_type, seed=3, **options)
    return hf_model, Engine(wrap_model(hf_model), seam_tokens=4)


def check_full_matches_transformers(hf_model, engine: Engine, seed: int = 0) -> None:
    """`full` against transformers' forward over the whole prompt (logits, 1e-4) and its cached greedy `generate`
    (16 tokens: a whole-prompt prefill from the zero state, then one-token decode steps)."""
    request = random_request(torch.Generator().manual_seed(seed), [23, 40, 17])
    ids = torch.tensor([request.all_ids()])
    with torch.no_grad():
        expected = hf_model(ids, use_cache=False).logits[0, -1]
        expected_tokens = hf_model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, ids.shape[1]:]
    torch.testing.assert_close(engine.prefill(request, "full").logits, expected, atol=1e-4, rtol=1e-4)
    generation = engine.generate(request, "full", SamplingParams(max_new_tokens=16))
    assert generation.token_ids == expected_tokens.tolist()
    assert len(generation.token_ids) == 16


def check_seams_and_prefix_are_exact(engine: Engine, seed: int = 1) -> None:
    """`hypic` with a seam covering every chunk equals `full` (1e-4); `prefix` equals `full` (1e-5), also when it
    reuses a checkpointed chunk boundary; `transition` is not exact (the check can fail)."""
    request = random_request(torch.Generator().manual_seed(seed), [9, 13, 5, 11])
    full = engine.prefill(request, "full").logits
    hypic = engine.prefill(request, "hypic", seam_tokens=13)
    torch.testing.assert_close(hypic.logits, full, atol=1e-4, rtol=1e-4)
    assert hypic.stats.recomputed_tokens == request.prompt_tokens - len(request.prefix_ids)
    torch.testing.assert_close(engine.prefill(request, "prefix").logits, full, atol=1e-5, rtol=1e-5)
    again = Request(request.prefix_ids, request.chunk_ids[:2] + [[1, 2, 3]], request.question_ids)
    reused = engine.prefill(again, "prefix")  # the boundary state after prefix + two chunks, checkpointed above
    assert reused.stats.prefix_reused_tokens == len(request.prefix_ids) + 9 + 13
    torch.testing.assert_close(reused.logits, engine.prefill(again, "full").logits, atol=1e-5, rtol=1e-5)
    assert (engine.prefill(request, "transition").logits - full).abs().max() > 1e-3


def check_linear_only_transition_is_exact(engine: Engine, chunks: int) -> None:
    """`engine`: a one-layer model whose layer is the family's recurrent mixer with conv kernel 1."""
    generator = torch.Generator().manual_seed(chunks)
    lengths = torch.randint(3, 30, (chunks,), generator=generator).tolist()
    request = random_request(generator, lengths, prefix=0)
    full = engine.prefill(request, "full")
    transition = engine.prefill(request, "transition")
    torch.testing.assert_close(transition.logits, full.logits, atol=1e-5, rtol=1e-5)
    for layer_index, state in full.state.linear.items():
        torch.testing.assert_close(transition.state.linear[layer_index].recurrent, state.recurrent, atol=1e-5, rtol=1e-5)
    assert (engine.prefill(request, "addition").logits - full.logits).abs().max() > 1e-3


def check_conv_tail_needs_the_seam(engine: Engine, seam: int) -> None:
    """A one-layer model with conv kernel seam + 1: `transition` misses the conv tail, `hypic` recomputes it."""
    request = random_request(torch.Generator().manual_seed(12), [15, 22, 9, 30], prefix=0)
    full = engine.prefill(request, "full").logits
    assert (engine.prefill(request, "transition").logits - full).abs().max() > 1e-3
    torch.testing.assert_close(engine.prefill(request, "hypic", seam_tokens=seam).logits, full, atol=1e-5, rtol=1e-5)


def mean_deviations(engine: Engine, modes: tuple[str, ...], requests: int = 20, seed: int = 0) -> dict[str, float]:
    """Mean KL(full || mode) of the next-token distribution over random requests (prefix 6, 2-5 chunks of 16-47
    tokens, question 8)."""
    generator = torch.Generator().manual_seed(seed)
    totals = dict.fromkeys(modes, 0.0)
    for _ in range(requests):
        count = int(torch.randint(2, 6, (1,), generator=generator))
        lengths = torch.randint(16, 48, (count,), generator=generator).tolist()
        request = random_request(generator, lengths, prefix=6, question=8)
        reference = engine.prefill(request, "full").logits
        for mode in modes:
            totals[mode] += kl_divergence(reference, engine.prefill(request, mode).logits) / requests
    return totals


def check_deviation_ordering(engine: Engine, *, moves_keys: bool) -> dict[str, float]:
    """hypic < transition_rope < addition (RoPE), hypic < transition < addition (NoPE: transition_rope is
    transition there)."""
    middle = "transition_rope" if moves_keys else "transition"
    totals = mean_deviations(engine, ("hypic", middle, "addition"))
    assert totals["hypic"] < totals[middle] < totals["addition"], totals
    return totals
