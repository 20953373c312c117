"""Prompt lookup (n-gram) proposals: no model. The last n tokens of a sequence (prompt and
output so far) are looked up earlier in the same sequence; the tokens that followed the most
recent earlier occurrence are the draft. Strong when the output quotes or edits its input
(code edits, summaries with quotes, retrieval answers), silent otherwise.

    token_ids:  ... a b c d e ... x y a b c ?    suffix "a b c" (n = 3) found earlier:
                    └─┬─┘ └┬┘                     draft "d e" (up to k tokens)
                   match   draft
"""

from __future__ import annotations

import numpy as np

from tandem.engine.sequence import Sequence
from tandem.engine.spec_decode.proposer import ProposeInput


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


class NgramProposer:
    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        # seq_id -> (the sequence's tokens as an array with room to grow, tokens in it)
        self._arrays: dict[int, tuple[np.ndarray, int]] = {}

    def propose(self, inp: ProposeInput) -> list[list[int]]:
        return [lookup(self._tokens(s), k, self.n_min, self.n_max)
                for s, k in zip(inp.seqs, inp.max_tokens)]

    def release(self, seq: Sequence) -> None:
        self._arrays.pop(seq.seq_id, None)

    def _tokens(self, seq: Sequence) -> np.ndarray:
        """seq.token_ids as int64, kept per sequence and extended by what it appended since
        (a step adds a few tokens; converting the whole list each step would cost O(length))."""
        ids = seq.token_ids
        arr, n = self._arrays.get(seq.seq_id, (None, 0))
        if arr is None or len(ids) > len(arr) or n > len(ids):
            arr = np.empty(max(2 * len(ids), 64), dtype=np.int64)
            n = 0
        arr[n:len(ids)] = ids[n:]
        self._arrays[seq.seq_id] = (arr, len(ids))
        return arr[:len(ids)]
