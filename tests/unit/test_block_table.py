"""The runner's block-table mirror stays equal to the scheduler's block lists through growth,
copy-on-write, preemption (a new list) and row reuse."""

from __future__ import annotations

import random

from tandem.engine.block_table import BlockTableMirror
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import Sequence


def test_mirror_tracks_block_lists_through_every_change():
    rng = random.Random(0)
    mirror = BlockTableMirror(rows=2, max_blocks=64)
    seqs = [Sequence(str(i), [1], SamplingParams()) for i in range(5)]
    next_block = iter(range(10**6))
    for _ in range(400):
        s = rng.choice(seqs)
        op = rng.random()
        if op < 0.5 and len(s.block_ids) < 64:
            s.block_ids.extend(next(next_block) for _ in range(rng.randint(1, 3)))
            s.block_ids[:] = s.block_ids[:64]
        elif op < 0.65 and s.block_ids:
            s.block_ids[-1] = next(next_block)  # copy-on-write of the last block
        elif op < 0.75:
            s.block_ids = [next(next_block) for _ in range(rng.randint(0, 4))]  # preempted
        elif op < 0.85:
            mirror.release(s.seq_id)  # finished; a later row() starts afresh
            continue
        if not s.block_ids:
            continue
        row = mirror.row(s)
        assert mirror.table[row, :len(s.block_ids)].tolist() == s.block_ids
    rows = [mirror.row(s) for s in seqs if s.block_ids]
    assert len(set(rows)) == len(rows)  # the table grew past its 2 initial rows
    width = max(len(s.block_ids) for s in seqs)
    got = mirror.gather(rows, width)
    for r, s in zip(got.tolist(), [s for s in seqs if s.block_ids]):
        assert r[:len(s.block_ids)] == s.block_ids
