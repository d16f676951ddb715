"""Decoder blocks: norms, residuals, multipliers and MLP / MoE around a block's mixers, over the model's own modules.

A block's `forward(hidden, mix, context)` runs the block's own arithmetic and asks `mix(mixer, x)` for each
mixer's output on its input x [..., T, hidden]. The caller decides how a mixer runs: the stack over a plan of
spans (seams, cached remainders, decode state), the encoder over standalone segments, the training forward over a
block layout; the block never knows. Families build blocks from the transformers module (`runtime/families/`):
- `ResidualBlock`: pre-norm, one mixer (or none: an MLP-only block, Nemotron-H), residual (times a multiplier,
  Granite), then an optional post-norm + MLP / MoE with its residual;
- `ParallelBlock`: one pre-norm feeding several mixers whose outputs are summed with input / output multipliers
  (Falcon-H1: attention and Mamba2 side by side), then norm + MLP.
Blocks of other shapes (Zamba2's shared attention block fed with the embeddings, MiniMax's scaled residuals)
subclass `Block`; `BlockContext.embeddings` carries the token embeddings of the tokens in flight.
A block holds at most one recurrent and one attention mixer: decode state and entry tensors are named by layer
index and part (`layers.{i}.transition`, `layers.{i}.key`), so each kind appears once per layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hypic_rag.entry.schema import ATTENTION_LAYER, LINEAR_LAYER, MLP_LAYER
from hypic_rag.runtime.layers import call_mlp, fuse_gate_up
from hypic_rag.runtime.mixers.base import AttentionMixer, Mixer, RecurrentMixer

MixFunction = Callable[[Mixer, torch.Tensor], torch.Tensor]
"""mix(mixer, x [..., T, hidden]) -> the mixer's output [..., T, hidden] for the tokens in flight."""


@dataclass(slots=True)
class BlockContext:
    """What a block may read besides its input: embeddings [..., T, hidden] of the tokens in flight.

    output_rows: when set, only these token rows of the block's output are wanted (the last layer of a pass that
    needs the last token's logits alone): a block may then run its MLP on those rows only and return
    [..., len(rows), hidden]. The mixers still see every row (their state and keys need them). A block that ignores
    it returns every row, which is also right (the caller selects the rows)."""

    embeddings: torch.Tensor
    output_rows: slice | None = None


def _keep_rows(hidden: torch.Tensor, context: BlockContext) -> torch.Tensor:
    """hidden [..., T, hidden] narrowed to `context.output_rows` (a view) when set."""
    return hidden if context.output_rows is None else hidden[..., context.output_rows, :]


class Block(ABC):
    """One decoder layer. `mixers`: its token mixers (at most one `RecurrentMixer` and one `AttentionMixer`)."""

    mixers: tuple[Mixer, ...] = ()

    @abstractmethod
    def forward(self, hidden: torch.Tensor, mix: MixFunction, context: BlockContext) -> torch.Tensor:
        """hidden [..., T, hidden] -> the block's output [..., T, hidden]."""

    @property
    def recurrent(self) -> RecurrentMixer | None:
        return next((m for m in self.mixers if isinstance(m, RecurrentMixer)), None)

    @property
    def attention(self) -> AttentionMixer | None:
        return next((m for m in self.mixers if isinstance(m, AttentionMixer)), None)

    @property
    def layer_type(self) -> str:
        """"linear_attention", "full_attention", both joined by "+" (a parallel block), or "mlp" (no mixer)."""
        kinds = [LINEAR_LAYER] * (self.recurrent is not None) + [ATTENTION_LAYER] * (self.attention is not None)
        return "+".join(kinds) or MLP_LAYER

    def check(self) -> None:
        """ValueError unless the block holds at most one mixer of each kind."""
        recurrent = sum(isinstance(m, RecurrentMixer) for m in self.mixers)
        attention = sum(isinstance(m, AttentionMixer) for m in self.mixers)
        if recurrent > 1 or attention > 1 or recurrent + attention != len(self.mixers):
            raise ValueError(f"a block holds at most one recurrent and one attention mixer, got {self.mixers}")


def _scaled(x: torch.Tensor, multiplier: float) -> torch.Tensor:
    return x if multiplier == 1.0 else x * multiplier


class ResidualBlock(Block):
    """h <- h + r * mixer(input_norm(h)); h <- h + r * mlp(mlp_norm(h)) (r: `residual_multiplier`).

    mixer None: an MLP-only block (h <- h + r * mlp(mlp_norm(h)) alone); mlp None: a mixer-only block.
    """

    def __init__(
        self, mixer: Mixer | None, input_norm: nn.Module | None, mlp: nn.Module | None = None,
        mlp_norm: nn.Module | None = None, residual_multiplier: float = 1.0,
    ) -> None:
        if mixer is not None and input_norm is None:
            raise ValueError("a block with a mixer needs its input norm")
        if mlp is not None and mlp_norm is None:
            raise ValueError("a block with an MLP needs the norm before it")
        self.mixer, self.input_norm, self.mlp, self.mlp_norm = mixer, input_norm, mlp, mlp_norm
        self.residual_multiplier = float(residual_multiplier)
        self.mixers = () if mixer is None else (mixer,)
        fuse_gate_up(mlp)
        self.check()

    def forward(self, hidden: torch.Tensor, mix: MixFunction, context: BlockContext) -> torch.Tensor:
        if self.mixer is not None:
            hidden = hidden + _scaled(mix(self.mixer, self.input_norm(hidden)), self.residual_multiplier)
        hidden = _keep_rows(hidden, context)
        if self.mlp is not None:
            hidden = hidden + _scaled(call_mlp(self.mlp, self.mlp_norm(hidden)), self.residual_multiplier)
        return hidden


@dataclass(frozen=True, slots=True)
class Branch:
    """One mixer of a `ParallelBlock`: it sees input_multiplier * x and contributes output_multiplier * output."""

    mixer: Mixer
    input_multiplier: float = 1.0
    output_multiplier: float = 1.0


class ParallelBlock(Block):
    """x = input_norm(h); h <- h + sum_b out_b * mixer_b(in_b * x); h <- h + mlp(mlp_norm(h))."""

    def __init__(
        self, branches: tuple[Branch, ...], input_norm: nn.Module, mlp: nn.Module | None = None,
        mlp_norm: nn.Module | None = None,
    ) -> None:
        if not branches:
            raise ValueError("a parallel block needs at least one branch")
        if mlp is not None and mlp_norm is None:
            raise ValueError("a block with an MLP needs the norm before it")
        self.branches, self.input_norm, self.mlp, self.mlp_norm = branches, input_norm, mlp, mlp_norm
        self.mixers = tuple(branch.mixer for branch in branches)
        self.check()
        fuse_gate_up(mlp)

    def forward(self, hidden: torch.Tensor, mix: MixFunction, context: BlockContext) -> torch.Tensor:
        x = self.input_norm(hidden)
        mixed = None
        for branch in self.branches:
            out = _scaled(mix(branch.mixer, _scaled(x, branch.input_multiplier)), branch.output_multiplier)
            mixed = out if mixed is None else mixed + out
        hidden = _keep_rows(hidden + mixed, context)
        if self.mlp is not None:
            hidden = hidden + call_mlp(self.mlp, self.mlp_norm(hidden))
        return hidden
