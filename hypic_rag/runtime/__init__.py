"""The runtime: a hybrid model and its engine over token ids (docs/runtime.md). The state algebra, encoding chunks
into entries, the stack pass, the modes and recompute policies, `ops/` (each op's torch reference and its dispatch
to the kernels), `families/` and `mixers/` (one adapter per architecture), `scheduler/` (continuous batching) and
`checkpoints/` (checkpoint directories read without transformers). It imports nothing above it: never the cache."""
