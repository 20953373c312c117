"""Speculative decoding's host-side parts: the back-off by acceptance
(engine/spec_decode/backoff.py), prompt lookup's index and its guess of whether a draft can
come while a step is in flight (engine/spec_decode/ngram.py)."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ngram_scan import lookup

from tandem.engine.async_step import PLACEHOLDER
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import Sequence
from tandem.engine.spec_decode.backoff import MAX_DOUBLINGS, AcceptanceBackOff
from tandem.engine.spec_decode.ngram import INDEX_TOKENS_PER_CALL, NgramProposer, SuffixIndex
from tandem.engine.spec_decode.proposer import ProposeInput


class Driver:
    """Steps a back-off for one sample that proposes whenever allowed; records, per step,
    whether it was allowed."""

    def __init__(self, b: AcceptanceBackOff, seq_id: int = 7) -> None:
        self.b, self.seq_id = b, seq_id
        self.allowed: list[bool] = []

    def step(self, proposed: int = 3, accepted: int = 0) -> None:
        self.b.tick()
        self.allowed.append(self.b.allows(self.seq_id))
        if self.allowed[-1] and proposed:
            self.b.record(self.seq_id, proposed, accepted)

    def probes(self) -> list[int]:
        """Steps (1-based) allowed after the first pause began."""
        first = self.allowed.index(False)
        return [i + 1 for i, a in enumerate(self.allowed) if a and i > first]


def test_pauses_and_probes():
    d = Driver(AcceptanceBackOff(min_acceptance=0.3, probe_interval=2))
    for _ in range(4):
        d.step(3, 0)  # 0.70, 0.49, 0.34, then 0.24 at step 4: paused until step 8 (on the grid)
    assert d.b.average(7) == pytest.approx(0.7 ** 4)
    for _ in range(4):
        d.step(3, 3)  # steps 5-7 paused; the probe at step 8 keeps everything: 0.47
    d.step(3, 0)  # 0.33: still speculating
    d.step(3, 3)
    assert d.allowed == [True] * 4 + [False] * 3 + [True] * 3
    assert d.b.counters.num_pauses == 1
    assert d.b.counters.num_paused_steps == 0  # counted by the speculator, not here
    d.b.release(7)
    assert d.b.average(7) == 1.0


def test_failed_probes_double_the_pause_up_to_a_cap():
    """A sample that never keeps a draft: pauses of at least 4, 8, 16, 32, 32, ... steps
    (interval 4, three doublings at most), each ending on a multiple of the interval: a probe
    on the grid that fails sits out its pause and the rest of that interval."""
    d = Driver(AcceptanceBackOff(min_acceptance=0.3, probe_interval=4))
    for _ in range(400):
        d.step(3, 0)
    probes = d.probes()
    gaps = [b - a for a, b in pairwise(probes)]
    assert gaps[:4] == [8 + 4, 16 + 4, 32 + 4, 32 + 4] and set(gaps[4:]) == {32 + 4}
    assert probes[0] == 12 and all(p % 4 == 0 for p in probes)  # paused at 4: 4 + 1 + 4 -> 12
    assert max(gaps) == (4 << MAX_DOUBLINGS) + 4


def test_a_good_verify_makes_the_next_pause_short_again():
    d = Driver(AcceptanceBackOff(min_acceptance=0.3, probe_interval=4))
    for _ in range(60):
        d.step(3, 0)
    long_pauses = d.probes()
    assert long_pauses[-1] - long_pauses[-2] > 8
    while d.b.average(7) < 0.3:  # probes that keep everything lift it back over
        d.step(3, 3)
    resumed = len(d.allowed)
    while d.allowed[-1]:
        d.step(3, 0)  # it falls below again: the pause is the first one's length
    paused_at = len(d.allowed) - 1
    while not d.allowed[-1]:
        d.step(3, 0)
    assert resumed < paused_at
    assert len(d.allowed) - paused_at <= 4 + 4  # a pause of 4, rounded up to the grid


def test_samples_paused_at_different_steps_probe_together():
    """A probe makes its whole step synchronous: batch-mates paused in different steps of
    one interval probe in the same step."""
    b = AcceptanceBackOff(min_acceptance=0.3, probe_interval=8)
    allowed: dict[int, list[int]] = {1: [], 2: []}
    for step in range(1, 80):
        b.tick()
        for sid in (1, 2):
            if b.allows(sid):
                allowed[sid].append(step)
                if sid == 1 or step > 2:  # sample 2 starts proposing two steps later
                    b.record(sid, 3, 0)
    after = [[s for s in allowed[sid] if s > 10] for sid in (1, 2)]
    assert after[0] and after[0] == after[1]


def test_off_never_pauses():
    off = AcceptanceBackOff(min_acceptance=0, probe_interval=2)
    for _ in range(10):
        off.tick()
        off.record(1, 3, 0)
    assert off.allows(1) and off.counters.num_pauses == 0


# -- prompt lookup with the last token in flight ------------------------------------------
def seq_of(tokens: list[int]) -> Sequence:
    return Sequence("r", tokens, SamplingParams())


def test_expects_draft_from_the_known_tokens():
    ngram = NgramProposer(2, 3)
    quoting = seq_of([4, 5, 6, 7, 1, 4, 5])  # "4 5" seen before, followed by 6
    quoting.token_ids.append(PLACEHOLDER)  # the next token is in flight
    assert ngram.expects_draft([quoting])
    fresh = seq_of([4, 5, 6, 7, 1, 2, 3])  # no suffix of 2+ tokens seen before
    fresh.token_ids.append(PLACEHOLDER)
    assert not ngram.expects_draft([fresh])
    assert ngram.expects_draft([fresh, quoting])  # one of them is enough
    # Nothing in flight: the same answer as the proposal itself.
    assert ngram.expects_draft([seq_of([4, 5, 6, 7, 1, 4, 5])])
    assert not ngram.expects_draft([seq_of([4, 5, 6, 7, 1, 2, 3])])


def test_expects_draft_never_caches_the_placeholder():
    """The known tokens are cached without the PLACEHOLDER: once the step resolves, the
    proposal reads the real token."""
    ngram = NgramProposer(2, 3)
    s = seq_of([4, 5, 6, 7, 1, 4])
    s.token_ids.append(PLACEHOLDER)
    ngram.expects_draft([s])
    s.token_ids[-1] = 5  # resolved
    assert ngram.propose(ProposeInput([s], [3])) == [[6, 7, 1]]


def long_prompts(count: int, length: int, quoting: bool) -> list[Sequence]:
    """Sequences of `length` random tokens (no n-gram repeats, as a random model's); with
    `quoting`, each ends with 3 tokens from its middle: a draft is found."""
    rng = np.random.default_rng(3)
    seqs = []
    for i in range(count):
        toks = rng.choice(1 << 20, length, replace=False).tolist()
        seqs.append(seq_of(toks + toks[100 + i:103 + i] if quoting else toks))
    return seqs


def indexed(ngram: NgramProposer) -> int:
    return sum(len(index.tokens) for index in ngram._indexes.values())


def test_index_catch_up_is_bounded_per_call():
    """Sequences that may all speculate at once (a large batch shrinking under the back-off's
    threshold: each first asked about with its whole prompt) are indexed over several calls,
    never more than INDEX_TOKENS_PER_CALL tokens in one (the step's host time stays small);
    one still behind gets no draft, then the scan's draft once caught up. Before the limit
    the first call indexed all 9,018 tokens."""
    seqs = long_prompts(6, 1500, quoting=True)
    want = [lookup(np.array(s.token_ids), 3, 2, 4) for s in seqs]
    assert all(want)
    ngram = NgramProposer(2, 4)
    per_call, drafted = [], []
    while not drafted or not all(drafted[-1]):
        before = indexed(ngram)
        drafted.append(ngram.propose(ProposeInput(seqs, [3] * len(seqs))))
        per_call.append(indexed(ngram) - before)
    total = sum(s.num_tokens for s in seqs)
    assert max(per_call) <= INDEX_TOKENS_PER_CALL
    assert sum(per_call) == total and len(per_call) == -(-total // INDEX_TOKENS_PER_CALL)
    caught = INDEX_TOKENS_PER_CALL // seqs[0].num_tokens  # those indexed whole by the first
    assert 0 < caught < len(seqs)
    assert drafted[0] == want[:caught] + [[]] * (len(seqs) - caught)
    assert drafted[-1] == want
    for s in seqs:  # then a step's few new tokens each
        s.token_ids.append(7)
    ngram.propose(ProposeInput(seqs, [3] * len(seqs)))
    assert indexed(ngram) == sum(s.num_tokens for s in seqs)


def test_expects_draft_catch_up_is_bounded_per_call():
    """With a step in flight and no sequence quoting its prompt (a random model's outputs),
    the calls that find no draft index at most INDEX_TOKENS_PER_CALL tokens each; once the
    quoting sequence behind them is caught up, a draft is expected."""
    seqs = long_prompts(5, 1500, quoting=False) + long_prompts(1, 1500, quoting=True)
    for s in seqs:
        s.token_ids.append(PLACEHOLDER)
    ngram = NgramProposer(2, 4)
    answers = []
    while not answers or not answers[-1]:
        before = indexed(ngram)
        answers.append(ngram.expects_draft(seqs))
        assert indexed(ngram) - before <= INDEX_TOKENS_PER_CALL
    calls = -(-indexed(ngram) // INDEX_TOKENS_PER_CALL)
    assert calls > 1 and answers == [False] * (calls - 1) + [True]
    assert not ngram.expects_draft(seqs[:5])  # caught up: a lookup each, no draft


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60),
       cuts=st.lists(st.integers(1, 7), min_size=1, max_size=20),
       n=st.tuples(st.integers(1, 4), st.integers(0, 3)), k=st.integers(1, 5))
def test_suffix_index_answers_as_the_scan(tokens, cuts, n, k):
    """The index, extended a few tokens at a time, gives the scan's draft at every length."""
    n_min, n_max = n[0], n[0] + n[1]
    index = SuffixIndex(n_min, n_max)
    end = 0
    for cut in cuts * 10:
        end = min(end + cut, len(tokens))
        index.extend(tokens, end)
        assert index.lookup(k) == lookup(np.array(tokens[:end]), k, n_min, n_max)
        if end == len(tokens):
            break
