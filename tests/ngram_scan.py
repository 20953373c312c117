"""Prompt lookup by a plain scan: the reference the suffix index (engine/spec_decode/ngram.py
SuffixIndex) is checked against."""

from __future__ import annotations

import numpy as np


def lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens following the latest earlier occurrence of the longest suffix of
    `tokens` (n_max down to n_min tokens long) that occurs earlier; [] if none does."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = tokens[size - n:]
        # Windows starting at 0 .. size - n - 1: every occurrence but the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []
