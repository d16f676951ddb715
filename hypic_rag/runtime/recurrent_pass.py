"""A recurrent mixer's layer in a stack pass: every item's recomputed runs and cached maps, for any mixer kind.

Each item (`layout.Layout`) walks its spans with its own running state h [*state_shape] and conv tail: a recomputed
run of a span runs the recurrence from h (its conv reads the running tail as its left context), a span's cached
remainder applies the entry's affine map h <- P h + Z (h + Z in `addition`; the product is the mixer's transition
kind, `segment_state.py`) and its conv tail replaces the running one. How the runs execute, per item:
- decode steps (every item one token after its state): one call of the recurrence over the stacked states
  [n, *state_shape];
- `packed`: the pass's only item with several runs, for a mixer that `scans_runs` (Gated DeltaNet on CPU), when no
  per-span checkpoint is wanted (several such items go `mapped` and through the wavefront, which batches them):
  its runs packed end to end through one conv and one scan, the cached maps between runs applied as the scan
  reaches each run (`RecurrentMixer.run_packed`);
- `mapped`: an item with several runs and cached spans between them otherwise: every run but its last evaluated
  from the identity start (one batched `run_with_transition` call per length class, across items), which gives
  each run's affine map, so the item's state walks through runs and cached spans as maps alone (the items in
  lockstep: each position's maps of every item in one batched product); each run's outputs then follow from its
  start state (`outputs_from_start`);
- the rest, and each mapped item's last run: the items' walks advance together, one step of every item at a time
  (a wavefront); the runs of a step go through the recurrence in one padded call per length class from their
  stacked states, the cached maps of a step are applied together.
A mixer without a recurrent state (LFM2's short conv) runs every run of every item at once. All of these are the
same recurrence, exact to float32 round-off: a batch gives each item what it gets alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from hypic_rag.entry.schema import SEAM_TOKENS, Entry, tensor_name
from hypic_rag.runtime import layers as L
from hypic_rag.runtime.layout import Layout
from hypic_rag.runtime.mixers.base import Projections, RecurrentMixer, TransitionRun
from hypic_rag.runtime.ops import backends
from hypic_rag.runtime.ops.compose import compose_in_order
from hypic_rag.runtime.ops.conv_tail import advance_tail_cached
from hypic_rag.runtime.segment_state import SegmentState
from hypic_rag.runtime.state import LinearLayerState
from hypic_rag.runtime.threads import wide_for

Cached = list[tuple[Entry, int]]
"""Consecutive cached remainders: (entry, tokens its span recomputes before it)."""


def apply_cached_maps(state: torch.Tensor, cached: Cached, layer_index: int, composition: str, kind: str) -> torch.Tensor:
    """Advance one sequence's recurrent state [*state_shape] over consecutive spans' cached remainders, in order.
    `ops.compose` picks the kernel: on CUDA one Triton launch for all of them (P/Z read in their storage dtype,
    float32 accumulation), else the torch fold. `addition` applies h + Z (no P)."""
    states = [entry[tensor_name(layer_index, "suffix_state")] for entry, _ in cached]
    transitions = None if composition == "addition" else [entry[tensor_name(layer_index, "transition")] for entry, _ in cached]
    return compose_in_order(state, transitions, states, kind)


@dataclass(slots=True)
class _Run:
    """One recomputed run: its walk, its first flat row, token count and conv left context [C, W]."""

    walk: int
    row: int
    count: int
    context: torch.Tensor


@dataclass(slots=True)
class _Step:
    """One step of a walk: run number `run`, or the consecutive cached remainders `cached`; `span`: the span the
    step belongs to (the last one's, for merged cached remainders); `ends_span`: the state after it is the state
    at that span's end."""

    span: int
    run: int | None = None
    cached: Cached = field(default_factory=list)
    ends_span: bool = False


@dataclass(slots=True)
class _Walk:
    """One item's walk over its spans in this layer: its steps, its run numbers in order, the conv tail after
    each span and at the end, and its running state [*state_shape] (float32)."""

    layout: Layout
    steps: list[_Step]
    runs: list[int]
    tails_after: list[torch.Tensor]
    tail: torch.Tensor
    state: torch.Tensor
    next_step: int = 0

    def keep_checkpoint(self, step: _Step, layer_index: int) -> None:
        """The state at a span end, for an item that wants checkpoints."""
        if step.ends_span and self.layout.want_checkpoints:
            self.layout.span_linear[step.span][layer_index] = LinearLayerState(self.state, self.tails_after[step.span])


class _Outputs:
    """The recurrence's outputs of every flat row, [R, *output_shape], made on the first write."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.tensor: torch.Tensor | None = None

    def write(self, row: int, count: int, outputs: torch.Tensor) -> None:
        """rows row .. row + count - 1 = outputs [>= count, *output_shape]."""
        if self.tensor is None:
            self.tensor = outputs.new_empty(self.rows, *outputs.shape[1:])
        self.tensor[row : row + count] = outputs[:count]


FAST_PATHS = True
"""Whether items may take the decode-step, `packed` and `mapped` ways (see the module docstring). False: every
item's every step through the wavefront, step by step: the plain reference the tests compare the fast ways with."""


def recurrent_layer(
    mixer: RecurrentMixer, layer_index: int, x: torch.Tensor, layouts: list[Layout], dtype: torch.dtype, shared: dict,
) -> torch.Tensor:
    """One recurrent mixer over the flat tokens x [R, hidden] of every item (see the module docstring). Returns
    [R, hidden]; sets each item's linear state of this layer (and its per-span states when it wants checkpoints).
    `shared`: what the pass's layers share (the packed rows of each item's runs)."""
    projections = mixer.project(x)  # token-wise, every item at once
    fast = FAST_PATHS
    if fast and all(layout.is_decode_step() and layer_index in layout.state.linear for layout in layouts):
        return _decode_steps(mixer, layer_index, projections, layouts, dtype)
    runs: list[_Run] = []
    walks = _walk_spans(mixer, layer_index, projections.preconv, layouts, runs)
    outputs = _Outputs(x.shape[0])
    if mixer.transition_kind is None:  # no state: every run of every item is independent
        for group in _length_classes(runs, list(range(len(runs)))):
            results, _ = mixer.run(_inputs(mixer, projections, runs, group, shared), None)
            for index, number in enumerate(group):
                outputs.write(runs[number].row, runs[number].count, results[index])
        for walk in walks:
            for step in walk.steps:
                walk.keep_checkpoint(step, layer_index)
    else:
        waves: list[_Walk] = []
        mapped: list[_Walk] = []
        # one item with several runs: its own packed scan; several such items: the wavefront batches their runs
        # (shorter than packed scans, docs/runtime.md; exactness: tests/runtime/test_batch_*)
        packing = mixer.scans_runs and sum(len(walk.runs) > 1 for walk in walks) == 1
        for walk in walks:
            several = fast and len(walk.runs) > 1
            if several and packing and not walk.layout.want_checkpoints:
                _run_packed(mixer, layer_index, projections, runs, walk, outputs, shared)
                continue
            if several and any(step.cached for step in walk.steps):
                mapped.append(walk)
            waves.append(walk)
        if mapped:
            _run_mapped(mixer, layer_index, projections, runs, mapped, outputs, shared)
        if waves:
            _run_waves(mixer, layer_index, projections, runs, waves, outputs, shared)
    for walk in walks:
        walk.layout.state.linear[layer_index] = LinearLayerState(walk.state, walk.tail)
    assert outputs.tensor is not None
    return mixer.output(outputs.tensor, projections, dtype)


def _walk_spans(
    mixer: RecurrentMixer, layer_index: int, preconv: torch.Tensor, layouts: list[Layout], runs: list[_Run]
) -> list[_Walk]:
    """Each item's walk: its steps over its spans, from its state in this layer (zeros for a new sequence), with
    each run's conv context (the running conv tail) added to `runs`."""
    device = preconv.device
    width = mixer.conv_width
    walks: list[_Walk] = []
    for layout in layouts:
        previous = layout.state.linear.get(layer_index)
        tail = previous.conv_tail.float() if previous is not None else mixer.empty_conv_tail(device)
        state = previous.recurrent.float() if previous is not None else mixer.zero_state(device)
        steps: list[_Step] = []
        numbers: list[int] = []
        tails_after: list[torch.Tensor] = []
        for span_number, (span, (offset, count)) in enumerate(zip(layout.spans, layout.offsets)):
            cached = span.cached
            if count:
                row = layout.row + offset
                numbers.append(len(runs))
                steps.append(_Step(span_number, run=len(runs)))
                runs.append(_Run(len(walks), row, count, tail))
                if cached < width or width == 0:  # else the cached remainder's own tail replaces it whole
                    tail = L.advance_conv_tail(tail, preconv[row : row + count])
            if cached:
                assert span.entry is not None
                if int(span.entry[SEAM_TOKENS]) != count:
                    raise ValueError(f"entry was encoded with seam {int(span.entry[SEAM_TOKENS])}, span recomputes {count}")
                if steps and steps[-1].run is None and not layout.want_checkpoints:
                    steps[-1].cached.append((span.entry, count))  # consecutive cached spans: one step
                    steps[-1].span = span_number
                else:
                    steps.append(_Step(span_number, cached=[(span.entry, count)]))
                tail = advance_tail_cached(tail, span.entry[tensor_name(layer_index, "conv_tail")], cached)
            steps[-1].ends_span = True
            tails_after.append(tail)
        walks.append(_Walk(layout, steps, numbers, tails_after, tail, state))
    return walks


# ---------------------------------------------------------------------------------------------- gathering runs


def _length_class(count: int) -> int:
    """Runs are padded to the longest of their length class (the next power of two: at most 2x padding)."""
    return 1 << max(0, (count - 1).bit_length())


def _length_classes(runs: list[_Run], numbers: list[int]) -> list[list[int]]:
    """Run numbers grouped by length class (each group is one padded call)."""
    groups: dict[int, list[int]] = {}
    for number in numbers:
        groups.setdefault(_length_class(runs[number].count), []).append(number)
    return list(groups.values())


def gather_runs(values: torch.Tensor, windows: list[tuple[int, int]]) -> torch.Tensor:
    """Rows (first, count) of values [R, ...] as [n, longest, ...], each run zero-padded at its end (a view when
    the one run is every row): a copy per run, the reference `RunGather` (what passes use) is tested against."""
    if len(windows) == 1 and windows[0] == (0, values.shape[0]):
        return values[None]
    longest = max(count for _, count in windows)
    if all(count == longest for _, count in windows):
        rows = torch.tensor([row for first, count in windows for row in range(first, first + count)], device=values.device)
        return values[rows].view(len(windows), longest, *values.shape[1:])
    out = values.new_zeros(len(windows), longest, *values.shape[1:])
    for index, (first, count) in enumerate(windows):
        out[index, :count] = values[first : first + count]
    return out


@dataclass(frozen=True, slots=True)
class RunGather:
    """`gather_runs` for one set of windows as at most two operations per tensor: `rows` [n * longest] the flat row
    each place of the padded batch [n, longest] reads (past a run's end, the run's first row; None when the one run
    is every row: a view), `past_end` [n * longest] bool (True past a run's end: zeroed) or None when every run is
    `longest` long. The same windows recur in every recurrent layer of a pass, so a pass builds one per group of
    runs (`_inputs`, kept in the pass's `shared`)."""

    rows: torch.Tensor | None
    past_end: torch.Tensor | None
    runs: int
    longest: int

    @classmethod
    def of(cls, windows: list[tuple[int, int]], total_rows: int, device: torch.device) -> RunGather:
        """The gather of `windows` (first row, count) out of `total_rows` rows."""
        longest = max(count for _, count in windows)
        if len(windows) == 1 and windows[0] == (0, total_rows):
            return cls(None, None, 1, longest)
        rows = [first + (step if step < count else 0) for first, count in windows for step in range(longest)]
        past_end = None
        if any(count < longest for _, count in windows):
            past_end = torch.tensor([step >= count for _, count in windows for step in range(longest)], device=device)
        return cls(torch.tensor(rows, dtype=torch.long, device=device), past_end, len(windows), longest)

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        """values [R, ...] -> [n, longest, ...]: each window's rows, zeros past its end (as `gather_runs`)."""
        if self.rows is None:
            return values[None]
        gathered = values.index_select(0, self.rows)
        if self.past_end is not None:
            gathered.masked_fill_(self.past_end.view(-1, *([1] * (values.dim() - 1))), 0)
        return gathered.view(self.runs, self.longest, *values.shape[1:])


def _inputs(mixer: RecurrentMixer, projections: Projections, runs: list[_Run], group: list[int], shared: dict):
    """The recurrence inputs of the runs `group`, padded to the longest (identity steps past each run's end)."""
    windows = [(runs[number].row, runs[number].count) for number in group]
    key = ("gather", tuple(windows))  # the same windows in every layer of the pass
    gather = shared.get(key)
    if gather is None:
        preconv = projections.preconv
        gather = shared[key] = RunGather.of(windows, preconv.shape[0], preconv.device)
    gathered = projections.map(gather)
    convolved = mixer.convolve(gathered.preconv, torch.stack([runs[number].context for number in group]))
    lengths = [count for _, count in windows]
    return mixer.recurrence_inputs(convolved, gathered, None if min(lengths) == max(lengths) else lengths)


# ---------------------------------------------------------------------------------------------- the ways runs run


def _decode_steps(
    mixer: RecurrentMixer, layer_index: int, projections: Projections, layouts: list[Layout], dtype: torch.dtype
) -> torch.Tensor:
    """One decode step of every item at once: item n's token is row n; its conv window is its conv tail and the
    token, its state steps once from the stacked states [n, *state_shape]. The same values as the walk."""
    previous = [layout.state.linear[layer_index] for layout in layouts]
    if len(previous) == 1 and previous[0].recurrent.device.type == "cpu":  # one sequence: views (never written)
        tails, starts = previous[0].conv_tail[None].float(), previous[0].recurrent[None].float()
    else:
        tails = torch.stack([state.conv_tail for state in previous]).float()  # [n, C, W]
        starts = torch.stack([state.recurrent for state in previous]).float()  # [n, *state_shape]
    outputs, new_tails, finals = mixer.step(projections, tails, starts)
    for number, layout in enumerate(layouts):
        layout.state.linear[layer_index] = LinearLayerState(finals[number], new_tails[number])
    return mixer.output(outputs, projections, dtype)


def _apply_cached_steps(
    walks: list[_Walk], steps: list[_Step], layer_index: int, kind: str
) -> None:
    """Each walk's state advanced over its step's cached maps (new tensors, never written in place): matrix maps
    P [H, K, K] of several walks in one batched product per position over their stacked states (in torch), the
    rest walk by walk (`apply_cached_maps`). Same values. Each item is charged its share of the time."""
    began = time.perf_counter()
    together = [
        (walk, step) for walk, step in zip(walks, steps)
        if kind == "matrix" and walk.layout.composition != "addition" and walk.state.dim() == 3
        and not backends.use_triton(walk.state)
    ]
    if len(together) < 2:
        together = []
    for walk, step in zip(walks, steps):
        if not any(walk is other for other, _ in together):
            walk.state = apply_cached_maps(walk.state, step.cached, layer_index, walk.layout.composition, kind)
    for position in range(max((len(step.cached) for _, step in together), default=0)):
        mapped = [(walk, step.cached[position][0]) for walk, step in together if position < len(step.cached)]
        if len(mapped) == 1:
            walk, entry = mapped[0]
            walk.state = apply_cached_maps(walk.state, [(entry, 0)], layer_index, "transition", kind)
            continue
        start = torch.stack([walk.state for walk, _ in mapped])  # [n, H, K, V]
        transitions = torch.stack([entry[tensor_name(layer_index, "transition")].float() for _, entry in mapped])
        suffixes = torch.stack([entry[tensor_name(layer_index, "suffix_state")].float() for _, entry in mapped])
        with wide_for(start.numel() * start.shape[-2]):
            ended = torch.baddbmm(suffixes.flatten(0, 1), transitions.flatten(0, 1), start.flatten(0, 1)).view_as(start)
        for index, (walk, _) in enumerate(mapped):
            walk.state = ended[index]
    share = (time.perf_counter() - began) / len(walks)
    for walk in walks:
        walk.layout.compose_seconds += share


def _run_waves(
    mixer: RecurrentMixer, layer_index: int, projections: Projections, runs: list[_Run], walks: list[_Walk],
    outputs: _Outputs, shared: dict,
) -> None:
    """The walks' remaining steps, advancing together one step of every walk at a time: the runs of a step go
    through the recurrence in one padded call per length class from their stacked states, the cached maps of a
    step are applied together."""
    kind = mixer.transition_kind or "matrix"
    while True:
        current = [(walk, walk.steps[walk.next_step]) for walk in walks if walk.next_step < len(walk.steps)]
        if not current:
            return
        running = {step.run: walk for walk, step in current if step.run is not None}
        for group in _length_classes(runs, list(running)):
            starts = torch.stack([running[number].state for number in group])
            results, finals = mixer.run(_inputs(mixer, projections, runs, group, shared), starts)
            for index, number in enumerate(group):
                outputs.write(runs[number].row, runs[number].count, results[index])
                running[number].state = finals[index]
        _end_steps(current, layer_index, kind)


def _end_steps(current: list[tuple[_Walk, _Step]], layer_index: int, kind: str) -> None:
    """The end of one lockstep step of the walks (each with its current step, whose runs are done): the cached
    maps of the steps without a run applied together, then every walk's checkpoint kept and its next step taken."""
    cached = [(walk, step) for walk, step in current if step.run is None]
    if cached:
        _apply_cached_steps([walk for walk, _ in cached], [step for _, step in cached], layer_index, kind)
    for walk, step in current:
        walk.keep_checkpoint(step, layer_index)
        walk.next_step += 1


def _apply_run_maps(stepping: list[tuple[_Walk, tuple[TransitionRun, int]]], kind: str) -> None:
    """Each walk's state advanced over one evaluated run's affine map ((the `TransitionRun`, the run's index in
    it)): the maps of several walks stacked and applied in one product over their stacked states; the same values
    as one walk at a time (`SegmentState.apply`)."""
    transitions = torch.stack([transition_run.segment.transition[index] for _, (transition_run, index) in stepping])
    states = torch.stack([transition_run.segment.state[index] for _, (transition_run, index) in stepping])
    start = torch.stack([walk.state for walk, _ in stepping])
    with wide_for(start.numel() * (start.shape[-2] if kind == "matrix" else 1)):
        ended = SegmentState(transitions, states, kind).apply(start)
    for number, (walk, _) in enumerate(stepping):
        walk.state = ended[number]


def _run_mapped(
    mixer: RecurrentMixer, layer_index: int, projections: Projections, runs: list[_Run], walks: list[_Walk],
    outputs: _Outputs, shared: dict,
) -> None:
    """Every run but each walk's last from the identity start (one `run_with_transition` call per length class):
    each run's map, its outputs from a zero start and what a start state adds. Each walk then steps through those
    maps and its cached maps up to its last run (its state at every run start kept), and each run's outputs follow
    from its start state. The walks are left at their last run (for `_run_waves`)."""
    kind = mixer.transition_kind or "matrix"
    early = [number for walk in walks for number in walk.runs[:-1]]
    evaluated: dict[int, tuple[TransitionRun, int]] = {}
    groups = _length_classes(runs, early)
    transition_runs = []
    for group in groups:
        transition_run = mixer.run_with_transition(_inputs(mixer, projections, runs, group, shared))
        transition_runs.append(transition_run)
        for index, number in enumerate(group):
            evaluated[number] = (transition_run, index)
    starts: dict[int, torch.Tensor] = {}
    while True:  # the walks in lockstep, one step of every walk at a time, up to each walk's last run
        current = [(walk, walk.steps[walk.next_step]) for walk in walks
                   if walk.steps[walk.next_step].run != walk.runs[-1]]
        if not current:
            break
        stepping = [(walk, step.run) for walk, step in current if step.run is not None]
        if stepping:
            for walk, number in stepping:
                starts[number] = walk.state
            _apply_run_maps([(walk, evaluated[number]) for walk, number in stepping], kind)
        _end_steps(current, layer_index, kind)
    for group, transition_run in zip(groups, transition_runs):
        start = torch.stack([starts[number] for number in group])
        results = mixer.outputs_from_start(transition_run.zero_outputs, transition_run.transition_outputs, start)
        for index, number in enumerate(group):
            outputs.write(runs[number].row, runs[number].count, results[index])


def packed_rows(counts: list[int], width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Where runs of `counts` tokens go when packed end to end with each run after the first preceded by its `width`
    context rows: (the packed rows of the runs' tokens [sum(counts)], the packed rows of the contexts
    [(n - 1) * width] or None)."""
    token_rows: list[int] = []
    context_rows: list[int] = []
    row = 0
    for number, count in enumerate(counts):
        if number and width:
            context_rows.extend(range(row, row + width))
            row += width
        token_rows.extend(range(row, row + count))
        row += count
    as_tensor = lambda rows: torch.tensor(rows, dtype=torch.long, device=device)  # noqa: E731
    return as_tensor(token_rows), (as_tensor(context_rows) if context_rows else None)


def pack_conv_inputs(
    preconv: torch.Tensor, contexts: list[torch.Tensor], rows: tuple[torch.Tensor, torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv inputs of runs packed end to end: preconv [T, C] (the runs' tokens in order), each run after the
    first preceded by its own left context contexts[r] [C, w] as w extra rows, so ONE causal conv over the packed
    rows gives every run's outputs with its own context. `rows`: `packed_rows` of the runs. Returns (packed [P, C],
    the packed rows of the T tokens [T])."""
    token_rows, context_rows = rows
    if context_rows is None:
        return preconv, token_rows
    packed = preconv.new_empty(token_rows.shape[0] + context_rows.shape[0], preconv.shape[-1])
    packed.index_copy_(0, token_rows, preconv)
    packed.index_copy_(0, context_rows, torch.stack(contexts[1:]).transpose(1, 2).reshape(-1, preconv.shape[-1]).to(preconv.dtype))
    return packed, token_rows


def _run_packed(
    mixer: RecurrentMixer, layer_index: int, projections: Projections, runs: list[_Run], walk: _Walk,
    outputs: _Outputs, shared: dict,
) -> None:
    """One walk through the mixer's `run_packed`: its runs (the item's rows, in order) packed end to end (one conv
    with each run's context in between, no padding), then one scan over them in order, the cached maps between runs
    applied to the state as the scan reaches each run; the cached maps after the last run last."""
    layout = walk.layout
    kind = mixer.transition_kind or "matrix"
    before: list[_Step | None] = []
    pending: _Step | None = None
    for step in walk.steps:
        if step.run is not None:
            before.append(pending)
            pending = None
        else:
            pending = step
    contexts = [runs[number].context for number in walk.runs]
    counts = [runs[number].count for number in walk.runs]
    width = contexts[0].shape[-1]
    key = ("packed_rows", id(layout), width)  # the same in every layer of the pass
    rows = shared.get(key)
    if rows is None:
        rows = shared[key] = packed_rows(counts, width, projections.preconv.device)
    item_rows = layout.rows
    packed, keep = pack_conv_inputs(projections.preconv[item_rows], contexts, rows)
    convolved = mixer.convolve(packed[None], contexts[0][None])
    if packed.shape[0] != keep.shape[0]:
        convolved = convolved[:, keep]
    inputs = mixer.recurrence_inputs(convolved, projections.map(lambda tensor: tensor[item_rows][None]))

    def before_run(run: int, state: torch.Tensor) -> torch.Tensor:
        step = before[run]
        if step is None:
            return state
        walk.state = state
        _apply_cached_steps([walk], [step], layer_index, kind)
        return walk.state

    results, walk.state = mixer.run_packed(inputs, counts, walk.state, before_run)
    outputs.write(layout.row, layout.recomputed, results[0])
    if pending is not None:
        _apply_cached_steps([walk], [pending], layer_index, kind)
    walk.next_step = len(walk.steps)

