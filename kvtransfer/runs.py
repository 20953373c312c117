"""A transfer's block pairs as runs: blocks adjacent on both sides move as one piece.

A pull copies block src_ids[i] of the peer's pool into block dst_ids[i] of ours. Consecutive
pairs whose source and destination ids both step by +1 (or both by -1) form a run, one
contiguous range on each side:

    pairs, in order:  4->0  5->1  6->2  7->3  9->8  12->20  11->19
    runs (src_start, dst_start, length):  (4, 0, 4)  (9, 8, 1)  (11, 19, 2)

A run is one copy of length * block_bytes bytes: one cudaMemcpyAsync on the copy engines, one
NIXL descriptor. A block allocator hands out runs (a fresh pool's blocks in order; a freed
sequence's blocks together, tail first, so a later request gets them descending), so a prompt's
blocks often form a few runs; randomly scattered ids form one run per block. Plain Python, no
torch: one pass, no sort (a pull's host time is on the decode worker's critical path).
"""

from __future__ import annotations

from collections.abc import Sequence


def block_runs(src_ids: Sequence[int], dst_ids: Sequence[int],
               limit: int | None = None) -> list[tuple[int, int, int]] | None:
    """(src_start, dst_start, length) of each run, in the pairs' order, each start the lowest
    id of its range; None as soon as there are more than `limit` runs. The id lists must be
    of equal length."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(dst_ids)} destination ids for {len(src_ids)} source ids")
    runs: list[tuple[int, int, int]] = []
    if not src_ids:
        return runs
    s0 = s1 = src_ids[0]
    d0 = d1 = dst_ids[0]
    step = 0  # +1 or -1 once the run has two blocks
    for s, d in zip(src_ids[1:], dst_ids[1:], strict=True):
        ds = s - s1
        if ds == d - d1 and (ds == step or (step == 0 and ds in (1, -1))):
            step, s1, d1 = ds, s, d
            continue
        runs.append((min(s0, s1), min(d0, d1), abs(s1 - s0) + 1))
        if limit is not None and len(runs) > limit:
            return None
        s0 = s1 = s
        d0 = d1 = d
        step = 0
    runs.append((min(s0, s1), min(d0, d1), abs(s1 - s0) + 1))
    if limit is not None and len(runs) > limit:
        return None
    return runs


def order_like(src_ids: Sequence[int], blocks: Sequence[int]) -> list[int]:
    """`blocks` (distinct free block ids, as many as src_ids) in an order under which the pairs
    (src_ids[i], result[i]) form few runs: each stretch of src_ids stepping by +1 or -1 takes
    the lowest ids of the current range of consecutive blocks, in the same direction; a range
    too short splits the stretch. A decode worker orders the blocks it allocates for a pull so
    (which of its fresh blocks holds which prompt block is its own choice); at most one run
    per source stretch plus one per gap in `blocks`."""
    if len(src_ids) != len(blocks):
        raise ValueError(f"{len(blocks)} blocks for {len(src_ids)} source ids")
    free = sorted(blocks)
    out: list[int] = []
    at = 0  # next unused index of free
    i = 0
    while i < len(src_ids):
        # the stretch of src_ids from i: its direction and length
        step = src_ids[i + 1] - src_ids[i] if i + 1 < len(src_ids) else 0
        j = i + 1
        if step in (1, -1):
            while j < len(src_ids) and src_ids[j] - src_ids[j - 1] == step:
                j += 1
        # the range of consecutive free ids from `at`, at most j - i of them
        k = at + 1
        while k < len(free) and k - at < j - i and free[k] == free[k - 1] + 1:
            k += 1
        chunk = free[at:k]
        out += chunk if step != -1 else chunk[::-1]
        i += len(chunk)
        at = k
    return out
