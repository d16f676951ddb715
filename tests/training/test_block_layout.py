"""The training forward in the cached layout (`block_layout_logits`) against its references: with nothing cached it
is transformers' own forward; with standalone-encoded chunks its logits at live positions are the runtime's `hypic`
prefill (the segment cache's entries, RoPE re-positioning, transition composition, recomputed seams)."""

from __future__ import annotations

import functools

import pytest
import torch

from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.model import wrap_model
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.stack import Span, run_stack
from kits.corpora import random_request as shared_random_request
from training.block_layout import block_layout_logits, build_layout
from training.model_config import ModelShape, build_config

SHAPE = ModelShape(hidden_size=48, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=24,
                   linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=24,
                   intermediate_size=96)
VOCAB = 97


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(0)
    hf_model = Qwen3_5ForCausalLM(build_config(SHAPE, VOCAB, eos_token_id=1, pad_token_id=0)).eval()
    with torch.no_grad():  # random decays that keep a state over a chunk, so composition errors would show
        for module in hf_model.modules():
            if hasattr(module, "A_log"):
                module.A_log.uniform_(-4.0, 0.5)
    return hf_model


random_request = functools.partial(shared_random_request, prefix=3, vocab=VOCAB, lowest=2)


def spans_of(request: Request) -> list[tuple[int, int]]:
    spans, position = [], len(request.prefix_ids)
    for chunk in request.chunk_ids:
        spans.append((position, len(chunk)))
        position += len(chunk)
    return spans


def test_without_cached_tokens_it_is_the_transformers_forward(model) -> None:
    generator = torch.Generator().manual_seed(1)
    token_ids = torch.randint(2, VOCAB, (3, 70), generator=generator)
    with torch.no_grad():
        expected = model(input_ids=token_ids, use_cache=False).logits
        got = block_layout_logits(model, token_ids)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("seam", [0, 2, 5])
def test_cached_layout_equals_the_runtime_hypic_prefill(model, seam: int) -> None:
    generator = torch.Generator().manual_seed(10 + seam)
    requests = [random_request(generator, [9, 4, 13]), random_request(generator, [7, 11], prefix=0, question=9)]
    token_ids = torch.zeros(2, max(r.prompt_tokens for r in requests), dtype=torch.long)
    for row, request in enumerate(requests):
        token_ids[row, : request.prompt_tokens] = torch.tensor(request.all_ids())
    layout = build_layout(token_ids, [spans_of(r) for r in requests], [seam, seam], pad_token_id=0)
    assert layout is not None and layout.num_cached > 0
    with torch.no_grad():
        logits = block_layout_logits(model, token_ids, layout)
        plain = block_layout_logits(model, token_ids)

    engine = Engine(wrap_model(model), seam_tokens=seam)
    for row, request in enumerate(requests):
        # the runtime's hypic prefill: prefix exact, every chunk recomputes `seam` tokens, the rest from its entry
        expected = engine.prefill(request, "hypic").logits
        last = request.prompt_tokens - 1
        torch.testing.assert_close(logits[row, last], expected, atol=5e-5, rtol=1e-4)
        # all question positions, through run_stack with all logits
        segments = request.segments
        seams = [0 if (request.prefix_ids and n == 0) else seam for n in range(len(segments))]
        spans, position = [], 0
        for segment, entry_seam in zip(segments, seams):
            entry = engine.encode_segment(segment, entry_seam)
            spans.append(Span(segment, position, min(entry_seam, len(segment)), entry))
            position += len(segment)
        spans.append(Span(request.question_ids, position, len(request.question_ids)))
        result = run_stack(engine.model, spans, want_all_logits=True)
        question = len(request.question_ids)
        torch.testing.assert_close(logits[row, last - question + 1 : last + 1], result.all_logits[-question:],
                                   atol=5e-5, rtol=1e-4)
        # and the layout matters: the fully attended forward differs at the question
        assert (plain[row, last] - logits[row, last]).abs().max() > 1e-3


def test_gradients_reach_the_standalone_encoding(model) -> None:
    generator = torch.Generator().manual_seed(7)
    request = random_request(generator, [10, 10])
    token_ids = torch.tensor([request.all_ids()])
    layout = build_layout(token_ids, [spans_of(request)], [2], pad_token_id=0)
    model.zero_grad()
    logits = block_layout_logits(model, token_ids, layout)
    logits[0, -1].logsumexp(-1).backward()
    assert model.model.embed_tokens.weight.grad is not None
    # tokens seen only through their standalone encoding (cached) still get a gradient
    cached_ids = token_ids[0][layout.cached[0]].unique()
    live_ids = token_ids[0][~layout.cached[0]].unique()
    only_cached = [int(t) for t in cached_ids if t not in live_ids]
    assert only_cached
    assert model.model.embed_tokens.weight.grad[only_cached].abs().sum() > 0
    model.zero_grad()


def test_build_layout_marks_tokens_after_each_seam() -> None:
    token_ids = torch.arange(20)[None].repeat(2, 1)
    layout = build_layout(token_ids, [[(2, 5), (7, 3)], [(0, 4)]], [2, None], pad_token_id=0)
    assert layout is not None
    assert layout.cached[0].nonzero().flatten().tolist() == [4, 5, 6, 9]
    assert not layout.cached[1].any()
    assert layout.documents.tolist() == [[2, 3, 4, 5, 6], [7, 8, 9, 0, 0]]
    assert layout.source_row[0, 9] == 1 and layout.source_position[0, 9] == 2
    assert build_layout(token_ids, [[(0, 3)], [(0, 3)]], [3, None], pad_token_id=0) is None
