"""Polynomial hashes of every fixed-width window of a text, in linear time (numpy, arithmetic mod 2**64).

hash(window at i) = sum_k code[i + k] * BASE**k  (mod 2**64), k < width, code = the character's code point.

`window_hashes` computes all of them at once from prefix sums: with P[i] = sum_{k < i} code[k] * BASE**k, the
window at i is (P[i + width] - P[i]) * BASE**-i, BASE being odd and so invertible mod 2**64. `window_hash` is the
reference: one window, summed in Python integers. A hash only proposes candidates; every candidate is verified
against the text, so collisions cost time, never correctness.
"""

from __future__ import annotations

import numpy as np

BASE = 0x9E3779B97F4A7C15
"""An odd 64-bit multiplier (the golden-ratio constant): invertible mod 2**64."""
MOD = 1 << 64
_INVERSE = pow(BASE, -1, MOD)


def text_codes(text: str) -> np.ndarray:
    """The code points of `text` as a uint64 array [len(text)]."""
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4").astype(np.uint64)


def _powers(base: int, count: int) -> np.ndarray:
    """[base**0, base**1, ..., base**(count - 1)] mod 2**64, uint64 [count]."""
    powers = np.full(count, base, dtype=np.uint64)
    if count:
        powers[0] = 1
    return np.cumprod(powers, dtype=np.uint64)  # uint64 arithmetic wraps: mod 2**64


def window_hashes(codes: np.ndarray, width: int) -> np.ndarray:
    """uint64 [n - width + 1]: the hash of every window of `width` codes of `codes` [n] (empty when n < width)."""
    if width < 1:
        raise ValueError(f"width must be positive, got {width}")
    count = codes.shape[0] - width + 1
    if count <= 0:
        return np.zeros(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        weighted = codes * _powers(BASE, codes.shape[0])
        prefix = np.concatenate([np.zeros(1, dtype=np.uint64), np.cumsum(weighted, dtype=np.uint64)])
        return (prefix[width:] - prefix[:count]) * _powers(_INVERSE, count)


def window_hash(text: str) -> int:
    """The hash of `text` taken as one window (the reference `window_hashes` is tested against)."""
    total = 0
    for power, character in enumerate(text):
        total = (total + ord(character) * pow(BASE, power, MOD)) % MOD
    return total
