"""Serial sections (`runtime/threads.py`): a pass over few rows runs its small operations on one intra-op thread and
its large products (the oneDNN linears, attention) on all of them; the results equal the unsectioned pass to
float32 round-off, and the thread count is always restored."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from hypic_rag.runtime import threads
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.fast_linear import fast_view
from hypic_rag.runtime.model import wrap_model
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.testing import build_tiny_model


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_section_narrows_to_one_thread_and_wide_gives_every_thread_back(two_threads, monkeypatch) -> None:
    monkeypatch.delenv("HYPIC_RAG_SERIAL_SMALL_OPS", raising=False)
    assert threads.wide_threads() is None
    with threads.serial_section(8):
        assert torch.get_num_threads() == 1 and threads.wide_threads() == 2
        with threads.wide():
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with threads.serial_section(4):  # nested: no-op, the outer section stays in charge
            assert torch.get_num_threads() == 1
        assert threads.wide_threads() == 2
    assert torch.get_num_threads() == 2 and threads.wide_threads() is None
    with threads.wide():  # outside a section: nothing changes
        assert torch.get_num_threads() == 2


@pytest.mark.parametrize("case", ["many rows", "switched off", "cuda device"])
def test_section_is_a_no_op_where_it_should_be(two_threads, monkeypatch, case: str) -> None:
    rows, device = (threads.SERIAL_MAX_ROWS + 1, "cpu") if case == "many rows" else (8, "cpu")
    if case == "switched off":
        monkeypatch.setenv("HYPIC_RAG_SERIAL_SMALL_OPS", "0")
    if case == "cuda device":
        device = "cuda"
    with threads.serial_section(rows, device):
        assert torch.get_num_threads() == 2 and threads.wide_threads() is None


def test_thread_count_is_restored_after_an_error(two_threads) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with threads.serial_section(8):
            with threads.wide():
                raise RuntimeError("boom")
    assert torch.get_num_threads() == 2 and threads.wide_threads() is None


def test_a_section_belongs_to_its_thread(two_threads) -> None:
    seen: list[int | None] = []
    with threads.serial_section(8):
        worker = threading.Thread(target=lambda: seen.append(threads.wide_threads()))
        worker.start()
        worker.join()
    assert seen == [None]


def test_fast_linear_inside_a_section_matches_and_keeps_the_section(two_threads) -> None:
    torch.manual_seed(0)
    layer = fast_view(nn.Linear(64, 96))
    x = torch.randn(40, 64)
    with torch.no_grad():
        outside = layer(x)
        with threads.serial_section(40):
            inside = layer(x)
            assert torch.get_num_threads() == 1
    torch.testing.assert_close(inside, outside, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next"])
def test_prefill_and_generation_equal_with_and_without_sections(two_threads, monkeypatch, model_type: str) -> None:
    """Every mode's logits and greedy tokens are the same with serial sections on and off (thread count changes
    only the order of float32 reductions), and the pass leaves the thread count as it found it."""
    engine = Engine(wrap_model(build_tiny_model(model_type, seed=4)), seam_tokens=4)
    generator = torch.Generator().manual_seed(5)

    def ids(n: int) -> list[int]:
        return torch.randint(0, 256, (n,), generator=generator).tolist()

    request = Request(ids(5), [ids(n) for n in (19, 7, 30, 12)], ids(6))
    results = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("HYPIC_RAG_SERIAL_SMALL_OPS", setting)
        results[setting] = {
            mode: engine.prefill(request, mode, seam_tokens=4).logits for mode in ("full", "hypic", "transition_rope")
        }
        results[setting]["tokens"] = engine.generate(request, "hypic", SamplingParams(max_new_tokens=8)).token_ids
        assert torch.get_num_threads() == 2
    assert results["0"]["tokens"] == results["1"]["tokens"]
    for mode in ("full", "hypic", "transition_rope"):
        torch.testing.assert_close(results["1"][mode], results["0"][mode], atol=1e-5, rtol=1e-5)


def test_wide_for_widens_large_products_only(two_threads) -> None:
    with threads.serial_section(8):
        with threads.wide_for(threads.WIDE_MIN_MULTIPLY_ADDS - 1):
            assert torch.get_num_threads() == 1
        with threads.wide_for(threads.WIDE_MIN_MULTIPLY_ADDS):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
    with threads.wide_for(threads.WIDE_MIN_MULTIPLY_ADDS):  # outside a section: nothing changes
        assert torch.get_num_threads() == 2


def test_composition_of_large_states_in_a_section_matches(two_threads) -> None:
    """`apply_in_order` widens for 128 x 128 states (above the threshold): same result as outside a section."""
    from hypic_rag.runtime.segment_state import apply_in_order

    generator = torch.Generator().manual_seed(1)
    start = torch.randn(16, 128, 128, generator=generator)
    transitions = [torch.randn(16, 128, 128, generator=generator) * 0.05 for _ in range(3)]
    states = [torch.randn(16, 128, 128, generator=generator) for _ in range(3)]
    outside = apply_in_order(start, transitions, states, "matrix")
    with threads.serial_section(8):
        inside = apply_in_order(start, transitions, states, "matrix")
        assert torch.get_num_threads() == 1
    torch.testing.assert_close(inside, outside, atol=1e-5, rtol=1e-5)


def test_linears_widen_by_size_inside_a_section(two_threads, monkeypatch) -> None:
    """A large weight (or product) runs on every thread, a tiny layer's stays on one (waking a thread costs it more
    than it saves); both give the results they give outside a section."""
    from hypic_rag.runtime.fast_linear import WIDE_MIN_WEIGHT, FastLinear

    seen: list[int] = []
    product = FastLinear._product
    monkeypatch.setattr(FastLinear, "_product", lambda self, x: (seen.append(torch.get_num_threads()), product(self, x))[1])
    torch.manual_seed(0)
    small, large = fast_view(nn.Linear(32, 48)), fast_view(nn.Linear(1024, WIDE_MIN_WEIGHT // 1024))
    x_small, x_large = torch.randn(4, 32), torch.randn(2, 1024)
    with torch.no_grad():
        expected = small(x_small), large(x_large)
        seen.clear()
        with threads.serial_section(4):
            got = small(x_small), large(x_large)
    assert seen == [1, 2]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_caller_may_count_its_own_size_against_its_own_limit(two_threads) -> None:
    """The packed scan counts elements against `SMALL_OPS_MAX_ELEMENTS`: at or under the limit it narrows."""
    with threads.serial_section(5, limit=5):
        assert torch.get_num_threads() == 1
    with threads.serial_section(6, limit=5):
        assert torch.get_num_threads() == 2
