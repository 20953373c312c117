"""tandem.kvtransfer.runs.block_runs: a transfer's block pairs as runs of blocks adjacent on both
sides (one copy each on the copy engines, one NIXL descriptor each)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.kvtransfer.runs import block_runs, order_like


def _pairs(runs: list[tuple[int, int, int]]) -> set[tuple[int, int]]:
    return {(s + i, d + i) for s, d, n in runs for i in range(n)}


def test_ascending_and_descending_runs_and_single_blocks() -> None:
    src = [4, 5, 6, 7, 9, 12, 11, 10, 30]
    dst = [0, 1, 2, 3, 8, 20, 19, 18, 5]
    assert block_runs(src, dst) == [(4, 0, 4), (9, 8, 1), (10, 18, 3), (30, 5, 1)]


def test_adjacent_on_one_side_only_is_no_run() -> None:
    # source ascending, destination descending: the ranges would pair the wrong blocks
    assert block_runs([1, 2, 3], [9, 8, 7]) == [(1, 9, 1), (2, 8, 1), (3, 7, 1)]
    # a run turning back is two runs: 5,6,7 then 6 again would repeat a source
    assert block_runs([5, 6, 7, 6], [0, 1, 2, 3]) == [(5, 0, 3), (6, 3, 1)]


def test_limit_gives_up_early_and_empty_is_no_run() -> None:
    assert block_runs([], []) == []
    assert block_runs([0, 2, 4], [0, 2, 4], limit=2) is None
    assert block_runs([0, 2, 4], [0, 2, 4], limit=3) == [(0, 0, 1), (2, 2, 1), (4, 4, 1)]
    assert block_runs(list(range(128)), list(range(128, 256)), limit=1) == [(0, 128, 128)]
    with pytest.raises(ValueError, match="2 destination ids for 3 source ids"):
        block_runs([0, 1, 2], [0, 1])


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(-1, 1)), min_size=0, max_size=60),
       st.randoms(use_true_random=False))
def test_runs_cover_exactly_the_pairs(steps, rng) -> None:
    """Whatever the ids (walks that step by -1, 0 or +1 make runs likely): the runs hold each
    pair once, each a contiguous range on both sides, in the pairs' order; no two neighbouring
    runs could have been one."""
    src, dst = [], []
    s, d = 100, 500
    for jump, step in steps:
        s, d = (s + step, d + step) if jump % 3 else (s + jump, d + rng.randint(1, 40))
        src.append(s)
        dst.append(d)
    dst = list(dict.fromkeys(dst))  # destinations are distinct in a pull
    src = src[:len(dst)]
    runs = block_runs(src, dst)
    assert sum(n for _, _, n in runs) == len(src)
    assert _pairs(runs) == set(zip(src, dst, strict=True))
    i = 0
    last = None  # the previous run's last pair and step (0: a single block)
    for s0, d0, n in runs:  # each run is the next n pairs, all stepping the same way
        chunk = list(zip(src[i:i + n], dst[i:i + n], strict=True))
        assert set(chunk) == {(s0 + k, d0 + k) for k in range(n)}
        if last is not None:
            (s1, d1), step = last
            ds = chunk[0][0] - s1
            assert not (ds == chunk[0][1] - d1 and ds in (1, -1) and step in (0, ds))
        last = chunk[-1], (chunk[1][0] - chunk[0][0] if n > 1 else 0)
        i += n


def _stretches(ids: list[int]) -> int:
    """Stretches of ids stepping by +1 or -1 (a single id is one)."""
    return len(block_runs(ids, ids))


@given(st.lists(st.integers(0, 300), unique=True, max_size=80), st.data())
def test_order_like_is_a_permutation_with_few_runs(src, data) -> None:
    """order_like gives back exactly the blocks, and the pairs form at most one run per
    source stretch plus one per gap between the blocks' ranges of consecutive ids."""
    blocks = data.draw(st.lists(st.integers(0, 300), unique=True, min_size=len(src),
                                max_size=len(src)))
    out = order_like(src, blocks)
    assert sorted(out) == sorted(blocks)
    gaps = sum(1 for a, b in zip(sorted(blocks), sorted(blocks)[1:]) if b != a + 1)
    assert len(block_runs(src, out)) <= _stretches(src) + gaps
