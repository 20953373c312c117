"""Requests waiting for admission, in the order the scheduler admits them. Plain Python.

Two orders (`SchedulerConfig.policy`):

    fcfs           priority (lower first), then arrival.
    critical-path  priority; then, among waiting requests, those on the batch's critical path
                   (their own remaining steps, prompt chunks plus outputs, reach the horizon:
                   the longest remaining output of any request, the fewest steps the work left
                   can take), longest output first; then the rest, shortest prompt first, except
                   that a request waiting longer than `max_wait_s` goes before them (oldest
                   first), so no prompt waits forever behind a stream of shorter ones.

A preempted sequence goes back in front of everything: it was admitted once and is recomputed.
Under critical-path a request moved here mid-stream (decoding elsewhere until now: the decode
scheduler never paces it) goes in front too, after those.
Each order is a heap with lazy deletion: an entry whose sequence has left the queue (admitted,
or finished while waiting) is dropped when it surfaces.

The queue also keeps the totals the critical-path scheduler paces by: the tokens still to run
for every queued sequence (its prompt and outputs so far to compute, plus its remaining
outputs, per sample) and the longest remaining output among them.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator

from tandem.engine.sequence import Sequence

POLICIES = ("fcfs", "critical-path")


def remaining_outputs(seq: Sequence, max_model_len: int) -> int:
    """Tokens this sequence may still generate: its max_tokens, capped by the model's length."""
    return max(0, min(seq.params.max_tokens - seq.num_output_tokens,
                      max_model_len - seq.num_tokens))


class WaitQueue:
    def __init__(self, policy: str, max_model_len: int, max_wait_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.critical_path = policy == "critical-path"
        self.max_model_len = max_model_len
        self.max_wait_s = max_wait_s
        self.clock = clock
        self.front: deque[Sequence] = deque()  # preempted, in the order they go back
        self._order = itertools.count()
        self._live: dict[int, tuple[int, int]] = {}  # seq_id -> (entry order, its tokens)
        self._fifo: list = []  # (priority, order, seq)
        self._longest: list = []  # (priority, -remaining outputs, order, seq)
        self._shortest: list = []  # (priority, prompt tokens to compute, order, seq)
        self.tokens = 0

    # -- contents ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __iter__(self) -> Iterator[Sequence]:
        """Every queued sequence, in the order admissions would take them today."""
        seqs = list(self.front) + [e[-1] for e in sorted(self._fifo) if self._is_live(e)
                                   and e[-1] not in self.front]
        return iter(seqs)

    def _is_live(self, entry: tuple) -> bool:
        seq = entry[-1]
        live = self._live.get(seq.seq_id)
        return live is not None and live[0] == entry[-2]

    def add(self, seq: Sequence) -> None:
        self._add(seq)
        if self.critical_path and seq.remote is not None and seq.remote.mid_stream:
            self.front.append(seq)  # decoding elsewhere until now: before what is paced

    def _add(self, seq: Sequence) -> None:
        order = next(self._order)
        outputs = remaining_outputs(seq, self.max_model_len)
        tokens = _prompt_left(seq) + outputs * seq.num_samples
        self._live[seq.seq_id] = (order, tokens)
        self.tokens += tokens
        prio = seq.params.priority
        heapq.heappush(self._fifo, (prio, order, seq))
        if self.critical_path:
            heapq.heappush(self._longest, (prio, -outputs, order, seq))
            heapq.heappush(self._shortest, (prio, seq.num_tokens, order, seq))

    def add_front(self, seq: Sequence) -> None:
        """A preempted sequence: first to be admitted again."""
        self._add(seq)
        self.front.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        _, tokens = self._live.pop(seq.seq_id)
        self.tokens -= tokens
        if self.front and seq in self.front:
            self.front.remove(seq)

    def remove_finished(self) -> None:
        for seq in [e[-1] for e in self._fifo if self._is_live(e) and e[-1].is_finished]:
            self.remove(seq)

    # -- order ---------------------------------------------------------------------------------
    def _top(self, heap: list) -> tuple | None:
        while heap and not self._is_live(heap[0]):
            heapq.heappop(heap)
        return heap[0] if heap else None

    def longest_outputs(self) -> int:
        """The longest remaining output among queued sequences (critical-path order only)."""
        top = self._top(self._longest)
        return -top[1] if top else 0

    def head(self, horizon: int = 0, paced: int = 0) -> Sequence | None:
        """The sequence to admit next. critical-path: `horizon` is the batch's fewest remaining
        steps and `paced` the tokens a step gives work off that path."""
        if self.front:
            return self.front[0]
        fifo = self._top(self._fifo)
        if fifo is None or not self.critical_path:
            return fifo[-1] if fifo else None
        longest = self._top(self._longest)
        shortest = self._top(self._shortest)
        # Priority first: a lower class waits behind any higher one.
        prio = min(longest[0], shortest[0], fifo[0])
        seq = longest[-1]
        if longest[0] == prio and _steps(seq, paced) - longest[1] >= horizon:
            return seq  # on the critical path
        if fifo[0] == prio and self.overdue(fifo[-1]):
            return fifo[-1]  # waited too long
        return shortest[-1] if shortest[0] == prio else fifo[-1]

    def overdue(self, seq: Sequence) -> bool:
        """Whether seq has waited longer than max_wait_s (critical-path: admitted before the
        shorter prompts, and not held back by pacing)."""
        return self.clock() - seq.arrival_time > self.max_wait_s

    def is_critical(self, seq: Sequence, horizon: int, paced: int) -> bool:
        """Whether seq's own remaining steps reach the horizon."""
        return _steps(seq, paced) + remaining_outputs(seq, self.max_model_len) >= horizon


def _prompt_left(seq: Sequence) -> int:
    """Tokens of seq's prompt (and outputs so far) still to compute here: none for a prompt
    whose KV is pulled whole from a prefill worker (role decode), which only decodes here."""
    if seq.remote is not None and not seq.remote.prefix:
        return 0
    return seq.num_tokens - seq.num_computed_tokens


def _steps(seq: Sequence, paced: int) -> int:
    """Steps the prompt left to compute takes in chunks of `paced` tokens."""
    return -(-_prompt_left(seq) // max(paced, 1))
