"""The fla wrappers' side of the contract, on CPU: `run_fla` hands fla time-major tensors under fla's keyword names
(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens: fla-core 0.6.0's signatures) and turns its
time-major output back. fla itself cannot run here; a stand-in with fla's documented contract, built on our naive
references, takes its place, so a transposed layout or a missing keyword fails."""

from __future__ import annotations

import pytest
import torch

from hypic_rag.kernels.fla_support import run_fla
from hypic_rag.runtime.ops.gated_delta_rule import naive_recurrent_gated_delta_rule
from hypic_rag.runtime.ops.lightning import naive_recurrent_lightning


def fla_contract(naive, with_beta: bool):
    """A function with fla's signature and layout ([B, T, H, D] in and out, final states [N, H, K, V])."""

    def function(*, q, k, v, g, scale, initial_state, output_final_state, cu_seqlens, beta=None):
        assert output_final_state and scale == 1.0 and initial_state.dtype == torch.float32
        assert (beta is not None) == with_beta
        head_major = [x.transpose(1, 2) for x in (q, k, v, g, *((beta,) if with_beta else ()))]
        bounds = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
        outputs, finals = [], []
        for number, (begin, end) in enumerate(zip(bounds, bounds[1:])):
            pieces = [x[:, :, begin:end] for x in head_major]
            output, final = naive(*pieces, initial_state[number : number + 1])
            outputs.append(output)
            finals.append(final)
        return torch.cat(outputs, dim=2).transpose(1, 2), torch.cat(finals)

    return function


@pytest.mark.parametrize("packed", [False, True])
def test_delta_rule_and_scalar_decay_calls_keep_the_layout(packed: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    heads, total, dim = 2, 11, 4
    q, k, v = (torch.randn(1, heads, total, dim, generator=generator) * 0.5 for _ in range(3))
    g, beta = -torch.rand(1, heads, total, generator=generator), torch.rand(1, heads, total, generator=generator)
    bounds = torch.tensor([0, 5, 11]) if packed else None
    starts = torch.randn(2 if packed else 1, heads, dim, dim, generator=generator)
    for naive, with_beta in ((naive_recurrent_gated_delta_rule, True), (naive_recurrent_lightning, False)):
        extra = (beta,) if with_beta else ()
        output, finals = run_fla(fla_contract(naive, with_beta), q, k, v, g, starts, bounds, *extra)
        assert output.shape == (1, heads, total, dim) and finals.shape == starts.shape
        cuts = [0, 5, 11] if packed else [0, 11]
        for number, (begin, end) in enumerate(zip(cuts, cuts[1:])):
            pieces = [x[:, :, begin:end] for x in (q, k, v, g, *extra)]
            expected_output, expected_final = naive(*pieces, starts[number : number + 1])
            torch.testing.assert_close(output[:, :, begin:end], expected_output)
            torch.testing.assert_close(finals[number : number + 1], expected_final)


def test_packed_calls_need_a_batch_of_one_and_a_start_per_sequence() -> None:
    q = torch.zeros(2, 1, 4, 3)
    with pytest.raises(ValueError, match="batch of one"):
        run_fla(None, q, q, q, q[..., 0], None, torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match="3 start states for 2 sequences"):
        run_fla(None, q[:1], q[:1], q[:1], q[:1, ..., 0], torch.zeros(3, 1, 3, 3), torch.tensor([0, 2, 4]))
