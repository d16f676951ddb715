"""Linear layers through oneDNN on CPU: `onednn_linear`, `FastLinear`, `fast_view`.

On CPU, `torch.nn.functional.linear` in float32 goes to the BLAS library's sgemm, which is slow for a few rows (a
batched decode step: one row per running sequence; docs/runtime.md has the measurements). oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`,
what inductor calls) reads the same dense weight, so the fast path costs no memory; its results agree with
`F.linear`, and a row's result alone with the same row among others, to float32 round-off (it may choose another
kernel for one row than for eight; tests/runtime/test_fast_linear.py).

`fast_view(module)` is the module tree the runtime drives: a structural copy of `module` whose submodules are new
objects holding the very same parameters and buffers (shared, never copied), with every plain `nn.Linear` a
`FastLinear`, whose forward takes the oneDNN path for CPU float32 inputs without autograd (one row: the BLAS
library's matrix-vector product, `ONE_ROW_BLAS`) and `F.linear` otherwise (GPU, other dtypes, gradients, or a torch
without oneDNN). The module it was made from is left as it was: its own
forward is still transformers' stock forward, and the packed weights below live beside it, on the view's linears. For a few rows at a time (2..`PACKED_MAX_ROWS`: a
batched decode step) it multiplies by a copy of the weight in oneDNN's blocked layout, made on first use and
remade when the weight changes: the 8-row products of a 174M-parameter model's decode step then take about as long
as the 1-row ones (the weights' memory traffic), against twice as long from the dense weight. The copies cost the
model's linear weights' memory once more; HYPIC_RAG_PACKED_LINEARS=0 turns them off (dense oneDNN only).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hypic_rag.runtime.threads import WIDE_MIN_MULTIPLY_ADDS, wide_threads

logger = logging.getLogger(__name__)


def _onednn_available() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):  # an op namespace a build lacks
        return False


ONEDNN = _onednn_available()
"""Whether this torch has oneDNN's linear (every x86 / ARM CPU build does; the fast path falls back without it)."""

PRIMITIVE_CACHE_CAPACITY = 128
"""How many compiled oneDNN primitives, and how many of PyTorch's oneDNN primitive descriptors per thread, a
process keeps: `ONEDNN_PRIMITIVE_CACHE_CAPACITY` and `LRU_CACHE_CAPACITY` (ideep's descriptor cache), each set here
unless the environment sets it (both are read when the first one is built, so importing this module first bounds
them). Both caches key on the problem shape (rows x weight) and keep 1024 by default: a service's prefills of ever
new lengths keep adding entries, so a worker's resident memory would grow burst after burst (docs/service.md,
"Memory under bursts"). A shape evicted is built again when it comes back."""
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(PRIMITIVE_CACHE_CAPACITY))
os.environ.setdefault("LRU_CACHE_CAPACITY", str(PRIMITIVE_CACHE_CAPACITY))


def onednn_eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `onednn_linear` takes the oneDNN path for these tensors: CPU float32, no gradient wanted, rows."""
    if not ONEDNN or x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    if weight.device.type != "cpu" or weight.dim() != 2 or x.dim() < 2 or x.numel() == 0 or weight.is_meta:
        return False
    if bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu"):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return False
    return True


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: x [..., in], weight [out, in], bias [out] -> [..., out]; through oneDNN when
    `onednn_eligible` (float32 round-off apart, the same values), else `F.linear` itself."""
    if not onednn_eligible(x, weight, bias):
        return F.linear(x, weight, bias)
    return _onednn_product(x, weight, bias)


def _onednn_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`onednn_linear` for tensors already known `onednn_eligible`."""
    if not x.is_contiguous():
        x = x.contiguous()
    if not weight.is_contiguous():
        weight = weight.contiguous()
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


ONE_ROW_BLAS = True
"""Whether `FastLinear` multiplies ONE row (a batch-1 decode step) by the BLAS library's product (`F.linear`; MKL's
matrix-vector kernel in the PyPI CPU build) instead of oneDNN's: for one row both only stream the weight, and MKL's
kernel does it faster (docs/benchmarks/peers.md, "Decode"). From two rows on oneDNN stays (`F.linear` is several
times slower there). False: oneDNN for one row too, the reference the tests compare with."""


PACKED_MAX_ROWS = 128
"""Up to this many rows, `FastLinear` uses its packed weight (beyond, the dense one is as fast: docs/runtime.md,
"CPU measurements behind the runtime's constants")."""


def packed_enabled() -> bool:
    """Whether `FastLinear` keeps packed weight copies (HYPIC_RAG_PACKED_LINEARS, default on)."""
    return os.environ.get("HYPIC_RAG_PACKED_LINEARS", "1").strip().lower() not in ("0", "false", "no", "off")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] (CPU float32) in oneDNN's blocked layout, for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] times a `pack_weight` weight, plus bias: [..., out] (x CPU float32, as `onednn_eligible`)."""
    return torch.ops.mkldnn._linear_pointwise(x if x.is_contiguous() else x.contiguous(), packed, bias, "none", [], "")


WIDE_MIN_WEIGHT = 1 << 20
"""Inside a serial section a linear layer gets every thread when its weight has at least this many elements (a
few rows through it are bound by reading the weight, which two threads do faster) or the product has at least
`threads.WIDE_MIN_MULTIPLY_ADDS` multiply-adds; smaller ones (a tiny model's layers) stay on one thread."""


def _worth_widening(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x [..., in] times weight [out, in] should run on every thread inside a serial section (the rule's
    measurements: docs/runtime.md)."""
    size = weight.numel()
    return size >= WIDE_MIN_WEIGHT or (x.numel() // max(x.shape[-1], 1)) * size >= WIDE_MIN_MULTIPLY_ADDS


def _widened(product: Callable[[torch.Tensor], torch.Tensor], input: torch.Tensor,  # noqa: A002
              weight: torch.Tensor) -> torch.Tensor:
    """product(input) (a product by `weight`), on every thread when inside a serial section and `_worth_widening`."""
    threads = wide_threads()  # inside a serial section: a large product wants every thread, a small one not
    if threads is None or not _worth_widening(input, weight):
        return product(input)
    torch.set_num_threads(threads)
    try:
        return product(input)
    finally:
        torch.set_num_threads(1)


class FastLinear(nn.Linear):
    """An `nn.Linear` whose forward is `onednn_linear`, through a packed weight copy for 2..`PACKED_MAX_ROWS` rows
    (made by `fast_view` over a plain `nn.Linear`'s parameters, never constructed directly)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's name)
        return _widened(self._product, input, self.weight)

    def _product(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        weight, bias = self.weight, self.bias
        if not onednn_eligible(input, weight, bias):
            return F.linear(input, weight, bias)
        rows = input.numel() // input.shape[-1]
        if rows == 1:  # one row (a decode step of one sequence): the BLAS library's product, see ONE_ROW_BLAS
            return F.linear(input, weight, bias) if ONE_ROW_BLAS else _onednn_product(input, weight, bias)
        if rows <= PACKED_MAX_ROWS and packed_enabled():
            return packed_linear(input, self._packed_weight(), bias)
        return _onednn_product(input, weight, bias)

    def _packed_weight(self) -> torch.Tensor:
        """The packed copy of the weight, remade when the weight was replaced or written in place."""
        weight = self.weight
        key = (weight.data_ptr(), weight._version)
        cached = self.__dict__.get("_packed")
        if cached is None or cached[0]() is not weight or cached[1] != key:
            cached = (weakref.ref(weight), key, pack_weight(weight))
            self.__dict__["_packed"] = cached
        return cached[2]


ONE_ROW_FUSED = True
"""Whether a `LinearGroup` multiplies ONE row (a batch-1 decode step) by its fused weight in one product. False:
each layer multiplies the row on its own (the reference the tests compare with)."""


class LinearGroup:
    """Linear layers that read the same input (a mixer's input projections, a gated MLP's gate and up), multiplied
    as one for one row.

    Made once when the runtime builds its blocks: when every layer is a `FastLinear` over CPU float32 weights of the
    same input width (biases all present or all absent), their weights are copied into one tensor [sum of outputs,
    in] and each layer's weight (and bias) parameter is pointed at its rows of it (`param.data` = a view: the same
    values, the same parameter objects, one copy of the weights; a module that shares the parameters, the caller's
    transformers model, sees the same values from the same memory). Layers already laid out that way (the model
    wrapped a second time) are taken as they are. A batch-1 decode step then streams the group's weights in one
    matrix-vector product instead of one per layer (one parallel region woken instead of several: fewer wakes of the
    sleeping OpenMP threads per token, docs/benchmarks/peers.md "Decode").

    `__call__(x)`: x [..., in] -> one tensor [..., out_i] per layer, in order. One row, `ONE_ROW_FUSED`, the layers
    still views of the fused weight (a weight replaced since, e.g. `model.to(...)`, makes the group fall back) and
    the input `onednn_eligible`: the fused product, split (views). Otherwise each layer's own forward (the
    reference): more rows keep each layer's packed oneDNN weight."""

    def __init__(self, linears: Sequence[nn.Module]) -> None:
        self.linears = tuple(linears)
        self.sizes = [int(linear.out_features) if isinstance(linear, nn.Linear) else 0 for linear in self.linears]
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self._pointers: tuple[int, ...] = ()
        if len(self.linears) > 1 and _fusable(self.linears):
            with torch.no_grad():
                self.weight = _fused_parameters([linear.weight for linear in self.linears])
                if self.linears[0].bias is not None:
                    self.bias = _fused_parameters([linear.bias for linear in self.linears])
            self._pointers = self._current_pointers()

    def _current_pointers(self) -> tuple[int, ...]:
        return tuple(tensor.data_ptr() for linear in self.linears
                     for tensor in ((linear.weight,) if linear.bias is None else (linear.weight, linear.bias)))

    @property
    def fused(self) -> bool:
        """Whether the layers' weights are (still) rows of this group's fused weight."""
        return self.weight is not None and self._current_pointers() == self._pointers

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weight = self.weight
        if (ONE_ROW_FUSED and weight is not None and x.numel() == x.shape[-1] and self.fused
                and onednn_eligible(x, weight, self.bias)):
            product = _widened(self._one_row, x, weight)
            return tuple(product.split(self.sizes, dim=-1))
        return tuple(linear(x) for linear in self.linears)

    def _one_row(self, x: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias) if ONE_ROW_BLAS else _onednn_product(x, self.weight, self.bias)


def _fusable(linears: Sequence[nn.Module]) -> bool:
    """Whether `LinearGroup` may fuse these layers: distinct `FastLinear`s over CPU float32 weights (not meta) of one
    input width, biases all present or all absent (float32 CPU)."""
    if not ONEDNN or not all(type(linear) is FastLinear for linear in linears):
        return False
    weights = [linear.weight for linear in linears]
    if len({id(weight) for weight in weights}) != len(weights) or len({weight.shape[1] for weight in weights}) != 1:
        return False
    if any(weight.is_meta or weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2
           for weight in weights):
        return False
    biases = [linear.bias for linear in linears]
    if all(bias is None for bias in biases):
        return True
    return all(bias is not None and bias.device.type == "cpu" and bias.dtype == torch.float32 and not bias.is_meta
               for bias in biases) and len({id(bias) for bias in biases}) == len(biases)


def _fused_parameters(parameters: list[torch.Tensor]) -> torch.Tensor:
    """One tensor whose leading-dim row ranges the `parameters` (in order) are views of: the tensor they already lie
    in, consecutively, or a new one they are copied into and pointed at (`param.data`)."""
    first = parameters[0]
    rows = sum(parameter.shape[0] for parameter in parameters)
    tail = tuple(first.shape[1:])
    step = first[0].numel() if first.dim() > 1 else 1
    consecutive = all(parameter.is_contiguous() for parameter in parameters) and all(
        later.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and later.storage_offset() == earlier.storage_offset() + earlier.numel()
        for earlier, later in zip(parameters, parameters[1:]))
    if consecutive:  # each one ends where the next begins, in one storage: their rows together are a view
        return first.detach().as_strided((rows, *tail), (step, *first.stride()[1:]) if first.dim() > 1 else (1,))
    fused = torch.cat([parameter.detach() for parameter in parameters])
    start = 0
    for parameter in parameters:
        parameter.data = fused[start : start + parameter.shape[0]]
        start += parameter.shape[0]
    return fused


def fast_view(module: nn.Module) -> nn.Module:
    """A structural copy of `module` for the runtime to drive; `module` itself is left exactly as it was.

    Every submodule below `module` (itself included) becomes a new object of the same class whose `__dict__` is a
    shallow copy of the original's: the same parameter and buffer tensors (shared: nothing is copied, an in-place
    weight update shows in both), the same config and hooks, its own training flag and its own child table. A
    module reached along several paths (tied or shared blocks) has one copy. Plain `nn.Linear` layers become
    `FastLinear` in the copy (subclasses of `nn.Linear`, which may compute something else, keep their class; without
    oneDNN every class is kept). Costs one Python object per module, never the weights' memory.
    """
    copies: dict[int, nn.Module] = {}

    def view(original: nn.Module) -> nn.Module:
        found = copies.get(id(original))
        if found is not None:
            return found
        copy = object.__new__(FastLinear if ONEDNN and type(original) is nn.Linear else type(original))
        copies[id(original)] = copy
        state = {name: (value.copy() if isinstance(value, (dict, set)) and name.startswith("_") else value)
                 for name, value in original.__dict__.items()}  # module bookkeeping tables: the copy's own
        state["_modules"] = {name: None if child is None else view(child) for name, child in original._modules.items()}
        state.pop("_packed", None)  # a packed weight belongs to the linear that made it
        object.__setattr__(copy, "__dict__", state)
        return copy

    return view(module)

