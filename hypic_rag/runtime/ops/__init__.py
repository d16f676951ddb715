"""Sequence-mixing operators and the cache's maps, one folder per op (fla's layout): `naive.py` (the float32
reference) beside the torch fast paths and one `dispatch.py` that picks the kernel per call; `backends.py` is the one
switch they ask (fla's kernels, our Triton kernels in `hypic_rag.kernels`, or torch). Only this package imports
`hypic_rag.kernels`."""
