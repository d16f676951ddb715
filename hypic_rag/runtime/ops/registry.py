"""The one registry of the ops' backends and the one dispatch that picks among them per call.

`OPS` maps each op's name to its `Op`: the float32 reference (`naive.py`), then its backends in the order they are
tried, each with the condition under which it is taken (`when`, over a `Probe` of the call: the tensor whose device
and time steps decide, the time steps, the `backend=` a caller asked for, the map kind). The first backend whose
condition holds runs the call; where none holds the reference does (logged at debug level). Backends are named
"module:function" and imported at their first call, so asking never imports triton, fla or a kernel module.

`dispatch(op)` turns a declared signature (a function whose body is never run) into the op's public function;
`dispatch_packed(op)` does the same for sequences packed along time (`cu_seqlens`): one call of a backend that takes
`cu_seqlens` (fla's varlen kernels) where the chosen one does, else the op once per sequence, each from its start
state. `select(op, tensor, ...)` names the backend a call would take. `ops/backends.py` holds the switches the
conditions ask (`use_fla`, `resolve`: `HYPIC_RAG_KERNELS`) and the table of what runs on CUDA per mixer kind.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from hypic_rag.runtime.ops import backends

logger = logging.getLogger(__name__)

Declared = TypeVar("Declared", bound=Callable[..., Any])

RECURRENT_MAX_TOKENS = 4
"""At or below this many tokens (the longest packed sequence for a packed call) the step-by-step recurrences run:
no padding to a chunk."""


@dataclass(slots=True)
class Probe:
    """What a backend's condition sees of a call: `tensor` (device, shape; None where the call has no map to
    probe), `length` (time steps, or the longest packed sequence), `requested` (the caller's `backend=`: "triton",
    "torch" or None) and `kind` (the cached maps' kind: "matrix", "scalar", "vector")."""

    tensor: torch.Tensor | None
    length: int = 0
    requested: str | None = None
    kind: str | None = None


@dataclass(frozen=True)
class Backend:
    """One implementation of an op: `run` ("module:function", imported at its first call) taken when `when(probe)`
    holds; `fixed` keywords it is always called with; `packed`: it takes `cu_seqlens` (sequences packed along
    time in a batch of one). It is called with the op's arguments that its signature names."""

    name: str
    run: str
    when: Callable[[Probe], bool]
    fixed: Mapping[str, Any] = field(default_factory=dict)
    packed: bool = False

    def call(self, arguments: Mapping[str, Any]) -> Any:
        function, takes = _loaded(self.run)
        return function(**{name: value for name, value in arguments.items() if name in takes}, **self.fixed)


@dataclass(frozen=True)
class Packed:
    """How an op runs sequences packed along time: `timed` (argument -> its time dimension), `output_like` (the
    argument whose shape the float32 output has), `state_shape` (one sequence's state shape from the arguments),
    `prepare` (arguments made ready before either path, e.g. a decay broadcast over time)."""

    timed: Mapping[str, int]
    output_like: str
    state_shape: Callable[[Mapping[str, Any]], tuple[int, ...]]
    prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None


@dataclass(frozen=True)
class Op:
    """An op: its float32 `reference` ("module:function"), its `backends` in the order they are tried, `probe` (the
    `Probe` of a call from its arguments) and `packed` (how it runs packed sequences, or None)."""

    name: str
    reference: str
    backends: tuple[Backend, ...]
    probe: Callable[[Mapping[str, Any]], Probe]
    packed: Packed | None = None

    def choose(self, probe: Probe) -> Backend:
        """The first backend whose condition holds for `probe`, else the reference (as a backend named "naive")."""
        for backend in self.backends:
            if backend.when(probe):
                return backend
        logger.debug("no backend of %s is eligible here; running its reference", self.name)
        return Backend("naive", self.reference, always)

    def run(self, arguments: Mapping[str, Any]) -> Any:
        return self.choose(self.probe(arguments)).call(arguments)


@functools.cache
def _loaded(target: str) -> tuple[Callable[..., Any], frozenset[str]]:
    """The function named "module:function" and the names of the parameters it takes."""
    module, _, name = target.partition(":")
    function = getattr(importlib.import_module(module), name)
    return function, frozenset(inspect.signature(function).parameters)


# The conditions, in words: what each backend needs of a call.

def always(probe: Probe) -> bool:
    return True


def few_tokens(probe: Probe) -> bool:
    """A few tokens (decode): the step-by-step recurrence beats padding to a chunk."""
    return probe.length <= RECURRENT_MAX_TOKENS


def fla_runs(op: str) -> Callable[[Probe], bool]:
    """fla's `op` may run the call: a time step to run, a CUDA tensor, fla importing, HYPIC_RAG_KERNELS not torch."""
    return lambda probe: probe.tensor.shape[2] > 0 and backends.use_fla(probe.tensor, op)


def fla_runs_few(op: str) -> Callable[[Probe], bool]:
    """fla's `op` may run the call, and it has a few tokens (fla's fused recurrent kernel)."""
    runs = fla_runs(op)
    return lambda probe: few_tokens(probe) and runs(probe)


def cuda_and_long(probe: Probe) -> bool:
    """A CUDA tensor and more than a few tokens (the blocked log-depth scan)."""
    return probe.tensor.is_cuda and probe.length > RECURRENT_MAX_TOKENS


def triton_switch(probe: Probe) -> bool:
    """Our Triton kernels: the caller's `backend=`, else `HYPIC_RAG_KERNELS` for the tensor (`backends.resolve`)."""
    return backends.resolve(probe.requested, probe.tensor) == "triton"


def triton_composes(probe: Probe) -> bool:
    """The Triton switch is on and a compose kernel takes maps of `kind` on this state (matrix P on [H, K, V],
    scalar / elementwise P on [H, K, V] or [D, N]); no probe tensor (nothing to compose): no."""
    if probe.tensor is None or not triton_switch(probe):
        return False
    if probe.kind == "matrix":
        return probe.tensor.dim() == 3
    return probe.kind in ("scalar", "vector") and probe.tensor.dim() in (2, 3)


# How each op's calls are probed, and how its packed sequences lie.

def time_steps_of(argument: str) -> Callable[[Mapping[str, Any]], Probe]:
    """The probe of a recurrence: `argument` [B, H or D, T, ...] decides by its device and T."""
    return lambda arguments: Probe(arguments[argument], arguments[argument].shape[2])


def switch_on(argument: str) -> Callable[[Mapping[str, Any]], Probe]:
    """The probe of a map op: `argument`'s device, the caller's `backend=` and the maps' kind."""
    return lambda arguments: Probe(arguments[argument], requested=arguments.get("backend"), kind=arguments.get("kind"))


def _batched_compose_probe(arguments: Mapping[str, Any]) -> Probe:
    """One request's state from the batch (the cached states, or the starts when no map is cached); none when
    there is no request."""
    states, start = arguments["states"], arguments["start"]
    stacked = states if states.shape[0] or start is None else start
    return Probe(stacked[0] if stacked.shape[0] else None, requested=arguments["backend"], kind=arguments["kind"])


def _head_major_state(arguments: Mapping[str, Any]) -> tuple[int, ...]:
    return arguments["key"].shape[1], arguments["key"].shape[-1], arguments["value"].shape[-1]


def _decay_over_time(arguments: dict[str, Any]) -> dict[str, Any]:
    """A scalar decay broadcastable to [1, H, T] (e.g. [H, 1]) made [1, H, T] float32 on the values' device."""
    decay = arguments["log_decay"].to(device=arguments["value"].device, dtype=torch.float32)
    return {**arguments, "log_decay": decay.expand(*arguments["query"].shape[:3])}


def _delta_rule(op: str, reference: str, kernels: str, torch_forms: str) -> Op:
    """The gated delta rule and KDA: fla's kernels on CUDA, else the torch recurrence for a few tokens, else the
    chunked WY form (`torch_forms`.recurrent / .chunk)."""
    return Op(
        op, reference,
        (
            Backend("fla_recurrent", f"{kernels}:fla_fused_recurrent_{op}", fla_runs_few(op), packed=True),
            Backend("fla", f"{kernels}:fla_chunk_{op}", fla_runs(op), packed=True),
            Backend("recurrent", f"{torch_forms}.recurrent:fused_recurrent_{op}", few_tokens),
            Backend("chunk", f"{torch_forms}.chunk:chunk_{op}", always),
        ),
        time_steps_of("query"),
        Packed(dict.fromkeys(("query", "key", "value", "log_decay", "beta"), 2), "value", _head_major_state),
    )


def _scalar_decay_backends(through_simple_gla: str, recurrent: str, chunk: str) -> tuple[Backend, ...]:
    """Lightning attention and Mamba2's SSD (one scalar decay per head and step): fla's simple GLA on CUDA (its
    recurrent form for a few tokens), else the torch recurrence for a few tokens, else the chunked form."""
    return (
        Backend("fla_recurrent", through_simple_gla, fla_runs_few("simple_gla"), {"recurrent": True}, packed=True),
        Backend("fla", through_simple_gla, fla_runs("simple_gla"), packed=True),
        Backend("recurrent", recurrent, few_tokens),
        Backend("chunk", chunk, always),
    )


OPS_PACKAGE = "hypic_rag.runtime.ops"
LIGHTNING = f"{OPS_PACKAGE}.lightning"
SSD = f"{OPS_PACKAGE}.ssd"
SCAN = f"{OPS_PACKAGE}.selective_scan"

OPS: dict[str, Op] = {
    "gated_delta_rule": _delta_rule(
        "gated_delta_rule", f"{OPS_PACKAGE}.gated_delta_rule.naive:naive_recurrent_gated_delta_rule",
        "hypic_rag.kernels.gated_delta_rule", f"{OPS_PACKAGE}.gated_delta_rule",
    ),
    "kda": _delta_rule(
        "kda", f"{OPS_PACKAGE}.kda.naive:naive_recurrent_kda", "hypic_rag.kernels.kda", f"{OPS_PACKAGE}.kda",
    ),
    "lightning": Op(
        "lightning", f"{LIGHTNING}.naive:naive_recurrent_lightning",
        _scalar_decay_backends(f"{LIGHTNING}.simple_gla:lightning_through_simple_gla",
                               f"{LIGHTNING}.recurrent:fused_recurrent_lightning", f"{LIGHTNING}.chunk:chunk_lightning"),
        time_steps_of("query"),
        Packed(dict.fromkeys(("query", "key", "value", "log_decay"), 2), "value", _head_major_state, _decay_over_time),
    ),
    "ssd": Op(
        "ssd", f"{SSD}.naive:naive_ssd",
        _scalar_decay_backends(f"{SSD}.simple_gla:ssd_through_simple_gla", f"{SSD}.recurrent:recurrent_ssd",
                               f"{SSD}.chunk:chunk_ssd"),
        time_steps_of("x"),
        Packed(dict.fromkeys(("x", "dt", "b", "c"), 2), "x",
               lambda arguments: (arguments["x"].shape[1], arguments["b"].shape[-1], arguments["x"].shape[-1])),
    ),
    "selective_scan": Op(
        "selective_scan", f"{SCAN}.naive:naive_selective_scan",
        (
            Backend("blocked", f"{SCAN}.scan:blocked_selective_scan", cuda_and_long),
            Backend("recurrent", f"{SCAN}.recurrent:recurrent_selective_scan", always),
        ),
        time_steps_of("x"),
        Packed({"x": 2, "dt": 2, "b": 1, "c": 1}, "x", lambda arguments: tuple(arguments["a"].shape)),
    ),
    "compose_in_order": Op(
        "compose_in_order", f"{OPS_PACKAGE}.compose.fold:naive_compose_in_order",
        (
            Backend("triton", f"{OPS_PACKAGE}.compose.fold:compose_in_order_triton", triton_composes),
            Backend("torch", f"{OPS_PACKAGE}.compose.fold:compose_in_order_torch", always),
        ),
        switch_on("start"),
    ),
    "compose_batched": Op(
        "compose_batched", f"{OPS_PACKAGE}.compose.naive:naive_compose",
        (
            Backend("triton", f"{OPS_PACKAGE}.compose.fold:compose_batched_triton", triton_composes),
            Backend("torch", f"{OPS_PACKAGE}.compose.fold:compose_batched_torch", always),
        ),
        _batched_compose_probe,
    ),
    "stitch_conv_tails": Op(
        "stitch_conv_tails", f"{OPS_PACKAGE}.conv_tail.naive:naive_stitch_conv_tails",
        (
            Backend("triton", "hypic_rag.kernels.conv_tail:stitch_conv_tails", triton_switch),
            Backend("torch", f"{OPS_PACKAGE}.conv_tail.step:stitch_conv_tails_torch", always),
        ),
        switch_on("tails"),
    ),
    "rotate_into": Op(
        "rotate_into", f"{OPS_PACKAGE}.rope.rotate:naive_rotate_into",
        (
            Backend("triton", f"{OPS_PACKAGE}.rope.rotate:rotate_into_triton", triton_switch),
            Backend("torch", f"{OPS_PACKAGE}.rope.rotate:rotate_into_torch", always),
        ),
        switch_on("buffer"),
    ),
}
"""Every op's reference and backends, in the order they are tried (docs/runtime.md has the table in words)."""


def select(op: str, tensor: torch.Tensor, length: int | None = None, *, requested: str | None = None,
           kind: str | None = None) -> str:
    """The name of the backend `op` takes for a call probed by `tensor` (time steps on dim 2 unless `length` says,
    e.g. the longest packed sequence), the caller's `requested` backend and the maps' `kind`."""
    steps = length if length is not None else (tensor.shape[2] if tensor.dim() > 2 else 0)
    return OPS[op].choose(Probe(tensor, steps, requested, kind)).name


def call(op: str, **arguments: Any) -> Any:
    """`op` on its arguments by name, through the backend it chooses (for the modules inside an op's package, which
    the package's public function imports)."""
    return OPS[op].run(arguments)


def _public(declared: Declared, signature: inspect.Signature, run: Callable[[dict[str, Any]], Any]) -> Declared:
    """`declared`'s name and docstring on a function of `signature` that runs `run(arguments by name)`. The
    arguments are matched to names without `Signature.bind` where the call is well formed (ops run per layer and
    token: a few microseconds count); anything else goes through `bind`, which raises Python's TypeError."""
    parameters = signature.parameters
    positional = tuple(name for name, parameter in parameters.items()
                       if parameter.kind is parameter.POSITIONAL_OR_KEYWORD)
    defaults = {name: parameter.default for name, parameter in parameters.items()
                if parameter.default is not parameter.empty}
    every = frozenset(parameters)

    @functools.wraps(declared)
    def call(*args: Any, **kwargs: Any) -> Any:
        if len(args) <= len(positional):
            arguments = {**defaults, **dict(zip(positional, args))}
            if not kwargs or (kwargs.keys() <= every and kwargs.keys().isdisjoint(positional[: len(args)])):
                arguments.update(kwargs)
                if len(arguments) == len(every):
                    return run(arguments)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return run(bound.arguments)

    call.__signature__ = signature  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]


def dispatch(op: str, like: Callable[..., Any] | None = None) -> Callable[[Declared], Declared]:
    """The op's public function from its declaration (name, docstring; the body is never run) with the signature
    of `like` (one of its backends; default: the declaration's own): each call runs the backend `OPS[op]` chooses."""
    entry = OPS[op]

    def public(declared: Declared) -> Declared:
        return _public(declared, inspect.signature(like or declared), entry.run)

    return public


def dispatch_packed(op: str, like: Callable[..., Any]) -> Callable[[Declared], Declared]:
    """The op's function for sequences packed along time in a batch of one, with the signature of `like` (the
    op's reference) and `cu_seqlens` [S + 1] (0 .. T, non-decreasing) after its last timed argument;
    `initial_state` [S, *state] or None. A packing backend runs the call when the op chooses one for the longest
    sequence and every sequence has a token, else the op runs per sequence. Returns (output shaped like
    `Packed.output_like`, final states [S, *state]), float32."""
    entry = OPS[op]
    layout = entry.packed
    assert layout is not None, f"{op} has no packed layout"
    parameters = list(inspect.signature(like).parameters.values())
    after = max(index for index, parameter in enumerate(parameters) if parameter.name in layout.timed) + 1
    bounds_parameter = inspect.Parameter("cu_seqlens", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                         annotation="list[int] | torch.Tensor")
    signature = inspect.signature(like).replace(parameters=[*parameters[:after], bounds_parameter, *parameters[after:]])

    def run(arguments: dict[str, Any]) -> Any:
        cu_seqlens, initial_state = arguments.pop("cu_seqlens"), arguments.pop("initial_state")
        probe = entry.probe(arguments).tensor
        bounds = packed_bounds(cu_seqlens, probe, initial_state)
        if layout.prepare is not None:
            arguments = layout.prepare(arguments)
        if probe.shape[2] and all(end > begin for begin, end in itertools.pairwise(bounds)):
            longest = max(end - begin for begin, end in itertools.pairwise(bounds))
            backend = entry.choose(Probe(probe, longest))
            if backend.packed:
                offsets = torch.tensor(bounds, dtype=torch.long, device=probe.device)
                return backend.call({**arguments, "initial_state": initial_state, "cu_seqlens": offsets})
        return each_sequence(entry, arguments, layout, bounds, initial_state)

    def public(declared: Declared) -> Declared:
        return _public(declared, signature, run)

    return public


def check_cu_seqlens(cu_seqlens: Sequence[int] | torch.Tensor, total: int, batch: int) -> list[int]:
    """The sequence bounds as ints: 0 .. total, non-decreasing, for a batch of one packed row."""
    bounds = [int(v) for v in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    if batch != 1 or not bounds or bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"cu_seqlens {bounds} must run from 0 to the {total} packed tokens of a batch of one")
    if any(later < earlier for earlier, later in itertools.pairwise(bounds)):
        raise ValueError(f"cu_seqlens {bounds} must be non-decreasing")
    return bounds


def packed_bounds(cu_seqlens: Sequence[int] | torch.Tensor, packed: torch.Tensor,
                  initial_state: torch.Tensor | None) -> list[int]:
    """The checked bounds of sequences packed along dim 2 of `packed` [1, H or D, T, ...], one start state each."""
    bounds = check_cu_seqlens(cu_seqlens, packed.shape[2], packed.shape[0])
    if initial_state is not None and initial_state.shape[0] != len(bounds) - 1:
        raise ValueError(f"{initial_state.shape[0]} start states for {len(bounds) - 1} sequences")
    return bounds


def each_sequence(
    op: Op, arguments: Mapping[str, Any], layout: Packed, bounds: list[int], initial_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed sequences one at a time through `op`: sequence n (time steps bounds[n] .. bounds[n+1] - 1 of
    every timed argument) from start state n ([1, *state], or zeros), written into a float32 output shaped like
    `layout.output_like`. An empty sequence keeps its start state (zeros without one). Returns (output,
    finals [S, *state])."""
    like = arguments[layout.output_like]
    state_shape = layout.state_shape(arguments)
    output = torch.zeros(*like.shape, dtype=torch.float32, device=like.device)
    time_dim = layout.timed[layout.output_like]
    finals = []
    for number, (begin, end) in enumerate(itertools.pairwise(bounds)):
        start = None if initial_state is None else initial_state[number : number + 1]
        if end == begin:
            finals.append(torch.zeros(1, *state_shape, dtype=torch.float32, device=like.device)
                          if start is None else start.float().clone())
            continue
        sliced = {name: arguments[name].narrow(dim, begin, end - begin) for name, dim in layout.timed.items()}
        piece, final = op.run({**arguments, **sliced, "initial_state": start})
        output.narrow(time_dim, begin, end - begin).copy_(piece)
        finals.append(final)
    if not finals:
        return output, torch.zeros(0, *state_shape, dtype=torch.float32, device=like.device)
    return output, torch.cat(finals)
