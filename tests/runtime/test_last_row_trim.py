"""The last block runs its MLP on the last token only when a pass wants the next-token logits alone
(`BlockContext.output_rows`): the logits equal the last row of the same pass's every-row logits, and the state it
leaves (keys, values, recurrent states) is the same, for blocks that trim (residual, parallel) and blocks that don't."""

from __future__ import annotations

import pytest
import torch

from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.model import wrap_model
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.stack import run_stack
from hypic_rag.testing import build_tiny_model


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe", "falcon_h1", "zamba2"])
def test_trimmed_last_block_equals_the_every_row_pass(model_type: str) -> None:
    engine = Engine(wrap_model(build_tiny_model(model_type, seed=2)), seam_tokens=3)
    generator = torch.Generator().manual_seed(9)
    vocab = engine.model.hf_model.config.get_text_config().vocab_size

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    request = Request(ids(4), [ids(n) for n in (11, 6, 15)], ids(5))
    for mode in ("full", "hypic"):
        plan = engine.plan_prefill(request, mode, seam_tokens=3)
        trimmed = run_stack(engine.model, plan.spans, initial=plan.initial, assembly=plan.assembly)
        every_row = run_stack(engine.model, plan.spans, initial=plan.initial, assembly=plan.assembly, want_all_logits=True)
        assert every_row.all_logits.shape[0] == trimmed.recomputed_tokens > 1
        torch.testing.assert_close(trimmed.logits, every_row.all_logits[-1], atol=1e-5, rtol=1e-5)
        for layer, state in every_row.state.linear.items():
            torch.testing.assert_close(trimmed.state.linear[layer].recurrent, state.recurrent, atol=1e-6, rtol=1e-6)
        for layer, state in every_row.state.attention.items():
            torch.testing.assert_close(trimmed.state.attention[layer].keys, state.keys, atol=1e-6, rtol=1e-6)
