"""What the peers benchmark's modules share (`peers.py`: agreement, TTFT and decode through llama-cpp-python;
`peers_serving.py`: throughput through llama-server): the error when a peer is missing, the tolerance, the sizes."""

from __future__ import annotations

from hypic_rag.errors import HypicError

LOGIT_TOLERANCE = 1e-3
"""Largest |llama.cpp logit - full-mode logit| allowed, as a fraction of the vector's largest |logit| (F32 both
sides; the kernels sum in different orders through every layer, so bit equality is not expected)."""

NEW_TOKENS = 48
"""New tokens of every generation both ways (end to end, decode, throughput)."""

THREADS = 2
"""Threads on each side (llama.cpp's `-t`/`-tb` or `n_threads`; this package's torch threads)."""


class PeerMissingError(HypicError):
    """The peer (llama-cpp-python, llama-server) or llama.cpp's converter is not where the benchmark looks."""
