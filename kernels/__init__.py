"""GPU kernels (the `gpu` extra: flash-linear-attention + triton). Importing this package never needs a GPU;
`hypic_rag.kernels.gated_delta_rule.fla_available()` says whether the fast path can run."""
