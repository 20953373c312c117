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

Each sequence's index is built lazily, by the first call that asks about it (a sequence in a
batch too large to speculate, or paused by the back-off, costs nothing), and each call indexes
at most INDEX_TOKENS_PER_CALL tokens: a sequence not caught up yet gets no draft in that call.
So when a large batch shrinks under the back-off's threshold and all its sequences may
speculate at once, their prompts are indexed over a few steps, not in one step that stalls
the device (32 prompts of 1,152 tokens took ~28 ms of host work in one step on a 2-core VM).
The index's keys are bytes, which the garbage collector does not track: tuple keys (3 a token)
made such a burst run ~150 collections of the young generations, and could bring on one of
the whole heap (67 ms in a process that had imported torch, on that VM).
"""

from __future__ import annotations

from array import array

from tandem.engine.async_step import PLACEHOLDER
from tandem.engine.sequence import Sequence
from tandem.engine.spec_decode.proposer import ProposeInput

# Tokens one call (a step's `expects_draft` or `propose`) indexes at most, over all its
# sequences: about 0.5 us a token on a 2-core VM (~1 ms for 2,048), well under one step of an
# 8B model at any batch; a prompt that long still proposes in its first step.
INDEX_TOKENS_PER_CALL = 2048


class SuffixIndex:
    """One sequence's tokens and, for each n-gram (n_min .. n_max tokens) ending before its
    last token, where its latest occurrence ends: the scan "the latest earlier occurrence of
    the longest suffix" in a few dictionary probes instead of a pass over the sequence per
    step. Extended as the sequence grows (its tokens never change once known).

    An n-gram's key is its tokens' bytes (int32 each: token ids are below 2**31), so n-grams
    of different lengths never share a key."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.tokens = array("i")
        self._ends: dict[bytes, int] = {}

    def extend(self, ids: list[int], end: int) -> None:
        """Index ids[len(tokens):end]: the n-grams ending at len(tokens) - 1 .. end - 2 (those
        ending before the new last token), each n's in increasing order so that the latest
        occurrence wins."""
        toks, ends = self.tokens, self._ends
        old = len(toks)
        if end <= old:
            return
        toks.extend(ids[old:end])
        lo = max(old - self.n_max, 0)
        data = toks[lo:end - 1].tobytes()  # the tokens of every new n-gram, 4 bytes each
        for n in range(self.n_min, self.n_max + 1):
            first = max(old - n, 0)  # the first new n-gram's start (it ends at old - 1)
            count = end - n - first  # starts first .. end - n - 1 (the last ends at end - 2)
            if count <= 0:
                continue
            a, w = 4 * (first - lo), 4 * n
            grams = [data[i:i + w] for i in range(a, a + 4 * count, 4)]
            ends.update(zip(grams, range(first + n - 1, first + n - 1 + count)))

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens following the latest earlier occurrence of the longest suffix of the
        tokens indexed (n_max down to n_min tokens long) that occurs earlier; [] if none."""
        toks = self.tokens
        size = len(toks)
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            e = self._ends.get(toks[size - n:].tobytes())
            if e is not None:
                return toks[e + 1:e + 1 + k].tolist()
        return []


class NgramProposer:
    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self._indexes: dict[int, SuffixIndex] = {}  # seq_id -> its tokens' index
        self._budget = 0  # tokens the current call may still index

    def propose(self, inp: ProposeInput) -> list[list[int]]:
        self._budget = INDEX_TOKENS_PER_CALL
        out = []
        for s, k in zip(inp.seqs, inp.max_tokens):
            index = self._caught_up(s, len(s.token_ids))
            out.append(index.lookup(k) if index is not None else [])
        return out

    def expects_draft(self, seqs: list[Sequence]) -> bool:
        """Whether the known tokens (those before the step in flight's PLACEHOLDERs, if any)
        of one of seqs predict a continuation (the module's doc)."""
        self._budget = INDEX_TOKENS_PER_CALL
        for seq in seqs:
            known = len(seq.token_ids)
            while known and seq.token_ids[known - 1] == PLACEHOLDER:
                known -= 1
            index = self._caught_up(seq, known)
            if index is not None and index.lookup(1):
                return True
        return False

    def release(self, seq: Sequence) -> None:
        self._indexes.pop(seq.seq_id, None)

    def _caught_up(self, seq: Sequence, known: int) -> SuffixIndex | None:
        """The index of seq.token_ids[:known], extended by what was appended since (a step
        adds a few tokens) within the call's budget; None while it is still behind. Never a
        PLACEHOLDER: it is replaced once its step resolves."""
        index = self._indexes.get(seq.seq_id)
        if index is None or len(index.tokens) > known:  # (a sequence never shrinks)
            index = self._indexes[seq.seq_id] = SuffixIndex(self.n_min, self.n_max)
        end = min(known, len(index.tokens) + self._budget)
        self._budget -= end - len(index.tokens)
        index.extend(seq.token_ids, end)
        return index if end == known else None
