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


class FastLinear(nn.Linear):
    """An `nn.Linear` whose forward is `onednn_linear`, through a packed weight copy for 2..`PACKED_MAX_ROWS` rows
    (made by `fast_view` over a plain `nn.Linear`'s parameters, never constructed directly)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Linear's name)
        threads = wide_threads()  # inside a serial section: a large product wants every thread, a small one not
        if threads is None or not _worth_widening(input, self.weight):
            return self._product(input)
        torch.set_num_threads(threads)
        try:
            return self._product(input)
        finally:
            torch.set_num_threads(1)

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

