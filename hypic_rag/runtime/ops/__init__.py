"""Sequence-mixing operators and the cache's maps, one folder per op (fla's layout): `naive.py` (the float32
reference) beside the torch fast paths; `registry.py` is the one table of every op's backends (our Triton kernels in
`hypic_rag.kernels`, fla's, torch) with the conditions under which each runs, and the one dispatch that picks per
call; `backends.py` holds the switches the conditions ask. Only this package imports `hypic_rag.kernels`."""
