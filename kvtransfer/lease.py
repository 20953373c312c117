"""Leases: a prefill worker pins a finished request's KV blocks until the decode worker that
pulls them says Release, or until the lease's time to live runs out.

Plain Python, no torch. Not thread-safe: the engine loop drives it, calling `expire(now)`
each step. Times are seconds on one monotonic clock (time.monotonic()), passed in so that
tests control them.
"""

from __future__ import annotations

import heapq
import uuid
from collections import Counter
from collections.abc import Iterable

from engine.errors import InvalidArgument


class LeaseTable:
    """Live leases, each a list of block ids with a deadline.

    A lease granted at `now` with `ttl_s` expires at `now + ttl_s`: `expire(t)` for any
    t >= that reclaims it. Releasing an unknown, already released or expired lease returns None
    and changes nothing: a late Release from a decode worker is normal, not an error.
    """

    def __init__(self) -> None:
        self._blocks: dict[str, tuple[int, ...]] = {}  # live leases
        # (deadline, lease id), a min-heap. A released lease's entry stays until its deadline
        # passes and expire() pops it; the heap holds at most the leases of the last TTL.
        self._deadlines: list[tuple[float, str]] = []
        self._refs: Counter[int] = Counter()  # block id -> live leases holding it

    def grant(self, block_ids: Iterable[int], ttl_s: float, now: float) -> str:
        """Pin `block_ids` until release or `now + ttl_s`; return the new lease's id.

        Ids are random (uuid4), not a counter, so a Release meant for a lease of an earlier run
        of this worker cannot match a lease of this one."""
        if not ttl_s > 0:
            raise InvalidArgument("ttl_s", f"must be > 0, got {ttl_s}")
        lease_id = uuid.uuid4().hex
        blocks = tuple(block_ids)
        self._blocks[lease_id] = blocks
        self._refs.update(blocks)
        heapq.heappush(self._deadlines, (now + ttl_s, lease_id))
        return lease_id

    def release(self, lease_id: str) -> list[int] | None:
        """End a lease; return its blocks for the caller to free, or None if it is not live."""
        blocks = self._blocks.pop(lease_id, None)
        if blocks is None:
            return None
        self._unref(blocks)
        return list(blocks)

    def expire(self, now: float) -> list[list[int]]:
        """End every lease whose deadline is <= now; return their block lists, earliest
        deadline first."""
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, lease_id = heapq.heappop(self._deadlines)
            blocks = self._blocks.pop(lease_id, None)
            if blocks is not None:  # else released before its deadline
                self._unref(blocks)
                expired.append(list(blocks))
        return expired

    def pinned_blocks(self) -> int:
        """How many distinct blocks live leases hold."""
        return len(self._refs)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._blocks

    def _unref(self, blocks: tuple[int, ...]) -> None:
        self._refs.subtract(blocks)
        for block in blocks:
            if self._refs[block] <= 0:
                del self._refs[block]
