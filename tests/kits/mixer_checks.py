"""The mixer interface's contract as executable checks, for the tests of every family (no test framework needed).

`check_recurrent_mixer(mixer, x)` runs a `RecurrentMixer` on random token inputs and asserts, in float32:
- the conv with an explicit tail: convolving tokens a..T-1 with the tail of tokens 0..a-1 equals the whole conv;
- splitting a run: running 0..a-1 then a..T-1 from its end state equals running 0..T-1 (outputs and end state);
- the transition: from any start S_0 the end state is `segment.apply(S_0)` and the outputs are
  `outputs_from_start(zero_outputs, transition_outputs, S_0)`; P has the mixer's `transition_shape`;
- padding: runs padded at their end with `lengths` end in the same states as unpadded runs.
"""

from __future__ import annotations

import torch

from hypic_rag.runtime import layers as L
from hypic_rag.runtime.mixers.base import RecurrentMixer


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, tolerance: float) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance, msg=lambda m: f"{what}: {m}")


@torch.no_grad()
def check_recurrent_mixer(mixer: RecurrentMixer, x: torch.Tensor, *, split: int | None = None, tolerance: float = 1e-5) -> None:
    """Assert the contract of `mixer` on x [T, hidden] (input-normalised tokens, T >= 2); see the module docstring.
    `split`: where to cut the run (default T // 2)."""
    length = x.shape[0]
    split = length // 2 if split is None else split
    device = x.device
    generator = torch.Generator(device="cpu").manual_seed(0)
    projections = mixer.project(x)
    whole = projections.map(lambda t: t[None])

    # conv with an explicit tail
    empty = mixer.empty_conv_tail(device)[None]
    convolved = mixer.convolve(whole.preconv, empty)
    tail = L.advance_conv_tail(mixer.empty_conv_tail(device), projections.preconv[:split])
    later = mixer.convolve(whole.preconv[:, split:], tail[None])
    _close(later, convolved[:, split:], "conv of the second part with the first part's tail", tolerance)

    inputs = mixer.recurrence_inputs(convolved, whole)
    everything = slice(0, 1)
    if mixer.transition_kind is None:
        outputs, _ = mixer.run(inputs, None)
        assert outputs.shape[:2] == (1, length), f"outputs must be token-major [n, T, ...], got {tuple(outputs.shape)}"
        return

    start = torch.randn(1, *mixer.state_shape, generator=generator).to(device)
    outputs, end = mixer.run(inputs, start)
    assert outputs.shape[:2] == (1, length), f"outputs must be token-major [n, T, ...], got {tuple(outputs.shape)}"
    assert tuple(end.shape) == (1, *mixer.state_shape), f"end state {tuple(end.shape)} vs {mixer.state_shape}"

    # splitting the run
    first_outputs, middle = mixer.run(inputs.select(everything, 0, split), start)
    second_outputs, second_end = mixer.run(inputs.select(everything, split, length), middle)
    _close(torch.cat([first_outputs, second_outputs], dim=1), outputs, "outputs of a split run", tolerance)
    _close(second_end, end, "end state of a split run", tolerance)

    # the transition of the span
    run = mixer.run_with_transition(inputs)
    assert run.segment.kind == mixer.transition_kind, f"segment kind {run.segment.kind} vs {mixer.transition_kind}"
    assert tuple(run.segment.transition.shape) == (1, *mixer.transition_shape), (
        f"transition {tuple(run.segment.transition.shape)} vs (1, {mixer.transition_shape})"
    )
    _close(run.segment.apply(start), end, "segment.apply(start) against the run's end state", tolerance)
    zero_outputs, _ = mixer.run(inputs, None)
    _close(run.zero_outputs, zero_outputs, "zero-start outputs", tolerance)
    _close(mixer.outputs_from_start(run.zero_outputs, run.transition_outputs, start), outputs, "outputs_from_start", tolerance)

    # padded runs: steps past a run's length leave its state alone
    short = max(1, split)
    padded = projections.map(lambda t: torch.stack([t, torch.cat([t[:short], torch.zeros_like(t[short:])])]))
    pair = mixer.convolve(padded.preconv, empty.expand(2, -1, -1))
    _, ends = mixer.run(mixer.recurrence_inputs(pair, padded, [length, short]), start.expand(2, *mixer.state_shape))
    _, alone = mixer.run(inputs.select(everything, 0, short), start)
    _close(ends[0], end[0], "end state of the full-length row of a padded batch", tolerance)
    _close(ends[1], alone[0], "end state of a run padded at its end", tolerance)

    # runs of one sequence packed in one row (`run_packed`, the mixer's own against the interface's reference)
    lengths = [split, length - split]
    packed_outputs, packed_end = mixer.run_packed(inputs, lengths, start[0])
    _close(packed_outputs, outputs, "run_packed outputs", tolerance)
    _close(packed_end[None], end, "run_packed end state", tolerance)
    scale = torch.rand(*mixer.state_shape, generator=generator).to(device)
    shift = torch.randn(*mixer.state_shape, generator=generator).to(device)

    def between(run: int, state: torch.Tensor) -> torch.Tensor:
        return state * scale + shift if run == 1 else state

    mapped_outputs, mapped_end = mixer.run_packed(inputs, lengths, start[0], between)
    reference_outputs, reference_end = RecurrentMixer.run_packed(mixer, inputs, lengths, start[0], between)
    _close(mapped_outputs, reference_outputs, "run_packed with a map between runs against the sequential reference", tolerance)
    _close(mapped_end, reference_end, "run_packed end state with a map between runs", tolerance)
