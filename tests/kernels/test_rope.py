"""The RoPE-into-buffer kernel (`hypic_rag.kernels.rope`) against `ops.rope.apply_rotary` with the tables of tiny
qwen3_5 models' own rotary modules (partial rotary; interleaved M-RoPE sections) and against its torch reference."""

from __future__ import annotations

import pytest
import torch

from hypic_rag.kernels.rope import rope_into
from hypic_rag.runtime.ops.rope import naive_rope_into
from hypic_rag.runtime import layers as L
from hypic_rag.testing import build_tiny_model
from kernel_support import DEVICE, STORAGE_DTYPES

MROPE = {
    "head_dim": 64,
    "rope_parameters": {
        "rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
        "mrope_interleaved": True, "mrope_section": [3, 3, 2],
    },
}


@pytest.fixture(scope="module", params=["partial", "mrope"])
def rotary(request):
    """(rotary module, head dim) of a tiny qwen3_5: 4 of 16 dims rotate; or 16 of 64 with M-RoPE sections 3/3/2."""
    model = build_tiny_model("qwen3_5", num_hidden_layers=1, **(MROPE if request.param == "mrope" else {}))
    return model.model.rotary_emb, model.config.head_dim


def test_rope_into_matches_apply_rotary_at_true_positions(rotary) -> None:
    module, head_dim = rotary
    cos, sin = L.rotary_tables(module, torch.arange(200), torch.zeros(1))
    assert cos.shape[-1] < head_dim  # partial rotary: the other dims pass through
    keys = torch.randn(2, 37, head_dim, generator=torch.Generator().manual_seed(0))
    buffer = torch.full((2, 120, head_dim), 7.0, device=DEVICE)
    out = rope_into(buffer, 50, keys.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), 131)
    assert out is buffer
    expected = L.apply_rotary(keys, cos[131:168], sin[131:168])
    assert float((out[:, 50:87].cpu() - expected).abs().max()) <= 1e-5
    assert bool((out[:, :50] == 7).all()) and bool((out[:, 87:] == 7).all())  # nothing else written


def test_rope_into_with_distinct_mrope_streams_and_strided_keys() -> None:
    """Tables from three different temporal / height / width position streams (a multimodal prompt), keys sliced
    out of a larger entry tensor (as the stack passes a cached chunk's keys past its seam)."""
    model = build_tiny_model("qwen3_5", num_hidden_layers=1, **MROPE)
    streams = torch.stack([torch.arange(90), torch.arange(90) * 2, torch.arange(90) // 3])[:, None]
    cos, sin = model.model.rotary_emb(torch.zeros(1), streams)
    cos, sin = cos[0], sin[0]
    entry_keys = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(1))
    keys = entry_keys[:, 8:]  # non-contiguous view
    out = rope_into(torch.zeros(2, 32, 64, device=DEVICE), 0, keys.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), 50)
    expected = L.apply_rotary(keys, cos[50:82], sin[50:82])
    assert float((out.cpu() - expected).abs().max()) <= 1e-5


@pytest.mark.parametrize("dtype", STORAGE_DTYPES, ids=str)
def test_rope_into_reads_storage_dtype_and_writes_buffer_dtype(rotary, dtype: torch.dtype) -> None:
    module, head_dim = rotary
    cos, sin = L.rotary_tables(module, torch.arange(64), torch.zeros(1))
    keys = torch.randn(3, 20, head_dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    for buffer_dtype in (torch.float32, dtype):
        out = rope_into(torch.zeros(3, 30, head_dim, dtype=buffer_dtype, device=DEVICE), 5, keys.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), 9)
        expected = naive_rope_into(torch.zeros(3, 30, head_dim, dtype=buffer_dtype), 5, keys, cos, sin, 9)
        assert out.dtype == buffer_dtype
        difference = (out.float().cpu() - expected.float()).abs()
        if buffer_dtype == torch.float32:
            assert float(difference.max()) <= 1e-5
        else:  # both round the same float32 value to 16 bits: at most one unit in the last place apart
            assert bool((difference <= torch.finfo(buffer_dtype).eps * expected.float().abs().clamp_min(1.0)).all())


def test_rope_into_rejects_out_of_range() -> None:
    cos = sin = torch.ones(10, 4, device=DEVICE)
    keys = torch.zeros(2, 6, 16, device=DEVICE)
    with pytest.raises(ValueError, match="outside"):
        rope_into(torch.zeros(2, 20, 16, device=DEVICE), 0, keys, cos, sin, 5)
    with pytest.raises(ValueError, match="do not fit"):
        rope_into(torch.zeros(2, 8, 16, device=DEVICE), 4, keys, cos, sin, 0)
