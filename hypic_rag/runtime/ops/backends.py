"""The switches that say which kernels may run a call: our Triton kernels, flash-linear-attention's (fla), or torch.

The conditions of the ops registry (`ops/registry.py`) ask here and nowhere else, and only `runtime/ops/` imports
`hypic_rag.kernels` (a structure test holds that). What runs on CUDA, per mixer kind, is the table `CUDA_KERNELS`
(docs/runtime.md).

`use_fla(tensor, op)`: fla's kernels for `op` ("gated_delta_rule", "kda", "simple_gla") run a call when the tensor
is on CUDA, fla imports, and `HYPIC_RAG_KERNELS` is not "torch". fla is never imported for a CPU tensor.
`use_triton(tensor)` follows `HYPIC_RAG_KERNELS` (read at every call):
- "auto" (default): the Triton kernels for CUDA tensors when triton imports; the torch path otherwise;
- "torch": the torch path everywhere;
- "triton": the Triton kernels whatever the device (CPU tensors then need `TRITON_INTERPRET=1`, set before the
  first kernel module is imported: how the CPU tests drive the runtime through the kernels).
Asking never imports triton for a CPU tensor in "auto" mode.
"""

from __future__ import annotations

import torch

from hypic_rag.kernels import kernel_mode, triton_enabled

BACKENDS = ("triton", "torch")
"""What a map op (compose, conv tail, rope) may be told to use (`backend=`), or picks itself (None)."""


CUDA_KERNELS: dict[str, dict[str, str]] = {
    "gated_deltanet": {
        "families": "qwen3_5, qwen3_5_moe, qwen3_next, olmo_hybrid",
        "recurrence": "fla chunk_gated_delta_rule (fused_recurrent_gated_delta_rule for <= 4 tokens), cu_seqlens for packed runs",
        "composition": "Triton compose (matrix P)",
    },
    "kda": {
        "families": "kimi_linear, bailing_hybrid",
        "recurrence": "fla chunk_kda (fused_recurrent_kda for <= 4 tokens), cu_seqlens for packed runs",
        "composition": "Triton compose (matrix P)",
    },
    "ssd": {
        "families": "granitemoehybrid, bamba, nemotron_h, falcon_h1, zamba2",
        "recurrence": "fla chunk_simple_gla (q = c, k = dt b, v = x, g = dt a; fused_recurrent_simple_gla for <= 4 "
                      "tokens), cu_seqlens for packed runs",
        "composition": "Triton compose_elementwise (scalar P per head)",
    },
    "lightning": {
        "families": "minimax",
        "recurrence": "fla chunk_simple_gla (g = -slope; fused_recurrent_simple_gla for <= 4 tokens), cu_seqlens for packed runs",
        "composition": "Triton compose_elementwise (scalar P per head)",
    },
    "selective_scan": {
        "families": "jamba",
        "recurrence": "torch blocked log-depth scan (fla has no Mamba1 kernel; mamba_ssm is not a dependency)",
        "composition": "Triton compose_elementwise (elementwise P [D, N])",
    },
    "short_conv": {"families": "lfm2", "recurrence": "none (torch causal conv)", "composition": "none (conv tail only)"},
    "attention": {
        "families": "every family's attention layers",
        "recurrence": "torch scaled_dot_product_attention (flash / efficient kernels)",
        "composition": "Triton rope_into for cached keys (RoPE); NoPE and MLA keys copied / rotated in torch",
    },
}
"""Which kernel runs each mixer kind's recurrence and its cached-map composition on CUDA (HYPIC_RAG_KERNELS=auto,
fla installed). The short convs run in torch everywhere; the conv tails go through `ops.conv_tail`."""

FLA_OPS = ("gated_delta_rule", "kda", "simple_gla")


def fla_ready(op: str) -> bool:
    """Whether fla's `op` can run here at all: CUDA present, `HYPIC_RAG_KERNELS` not "torch", fla's op imports."""
    if op not in FLA_OPS:
        raise ValueError(f"unknown fla op {op!r}; expected one of {', '.join(FLA_OPS)}")
    if kernel_mode() == "torch" or not torch.cuda.is_available():
        return False
    from hypic_rag.kernels.fla_support import fla_importable

    return fla_importable(op)


def use_fla(tensor: torch.Tensor, op: str) -> bool:
    """Whether fla's kernels for `op` should run a call on `tensor` (see the module docstring)."""
    return bool(getattr(tensor, "is_cuda", False)) and fla_ready(op)


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether our Triton kernels should run on `tensor` (see the module docstring)."""
    return triton_enabled(tensor)


def resolve(backend: str | None, tensor: torch.Tensor) -> str:
    """`backend` checked ("triton" / "torch"), or the switch's choice for `tensor` when it is None."""
    if backend is None:
        return "triton" if use_triton(tensor) else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    return backend
