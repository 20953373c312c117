"""Prompt lookup (n-gram) proposals: no model. The last n tokens of a sequence (prompt and
output so far) are looked up earlier in the same sequence; the tokens that followed the most
recent earlier occurrence are the draft. Strong when the output quotes or edits its input
(code edits, summaries with quotes, retrieval answers), silent otherwise.

    token_ids:  ... a b c d e ... x y a b c ?    suffix "a b c" (n = 3) found earlier:
                    └─┬─┘ └┬┘                     draft "d e" (up to k tokens)
                   match   draft

With a pipelined step in flight, a sequence's last token is not known on the host yet, and
resolving the step to learn it makes the step synchronous (engine/llm_engine.py `_speculate`).
`expects_draft` answers from the tokens known: a draft after the unknown token x needs a
suffix "... c x" found earlier, so the known suffix "... c" found earlier too, followed by x.
It says yes when the known tokens' own lookup finds a match (a prediction of x, usually the
quote being followed); no when they have none, though x might still start one: then the step
stays pipelined and that draft is missed (drafts change only the speed, never the tokens).
"""

from __future__ import annotations

import numpy as np

from tandem.engine.async_step import PLACEHOLDER
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


class SuffixIndex:
    """One sequence's tokens and, for each n-gram (n_min .. n_max tokens) ending before its
    last token, where its latest occurrence ends: `lookup` in a few dictionary probes instead
    of a scan of the whole sequence per step, the same answer. Extended as the sequence
    grows (its tokens never change once known)."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], int] = {}

    def extend(self, ids: list[int], end: int) -> None:
        """Index ids[len(tokens):end]."""
        toks, ends = self.tokens, self._ends
        for p in range(len(toks), end):
            toks.append(ids[p])
            # The n-grams ending at p - 1 now occur before the last token.
            for n in range(self.n_min, min(self.n_max, p) + 1):
                ends[tuple(toks[p - n:p])] = p - 1

    def lookup(self, k: int) -> list[int]:
        """`lookup(tokens, k, n_min, n_max)` of the tokens indexed."""
        toks = self.tokens
        size = len(toks)
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            e = self._ends.get(tuple(toks[size - n:]))
            if e is not None:
                return toks[e + 1:e + 1 + k]
        return []


class NgramProposer:
    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self._indexes: dict[int, SuffixIndex] = {}  # seq_id -> its tokens' index

    def propose(self, inp: ProposeInput) -> list[list[int]]:
        return [self._index(s, len(s.token_ids)).lookup(k)
                for s, k in zip(inp.seqs, inp.max_tokens)]

    def expects_draft(self, seq: Sequence) -> bool:
        """Whether the known tokens (those before the step in flight's PLACEHOLDERs, if any)
        predict a continuation (the module's doc)."""
        known = len(seq.token_ids)
        while known and seq.token_ids[known - 1] == PLACEHOLDER:
            known -= 1
        return bool(self._index(seq, known).lookup(1))

    def release(self, seq: Sequence) -> None:
        self._indexes.pop(seq.seq_id, None)

    def _index(self, seq: Sequence, known: int) -> SuffixIndex:
        """The index of seq.token_ids[:known], extended by what it appended since (a step
        adds a few tokens). Never a PLACEHOLDER: it is replaced once its step resolves."""
        index = self._indexes.get(seq.seq_id)
        if index is None or len(index.tokens) > known:  # (a sequence never shrinks)
            index = self._indexes[seq.seq_id] = SuffixIndex(self.n_min, self.n_max)
        index.extend(seq.token_ids, known)
        return index
