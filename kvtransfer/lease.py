"""Leases: a prefill worker pins a finished request's KV blocks until the decode worker that
pulls them says Release, or until the lease's time to live runs out.

A lease's id is its capability: 128 random bits, known only to the prefill worker, the router
and the decode worker the router hands it to. Two tables, both keyed by it:

    LeaseTable  (engine core)     the blocks stay pinned: grant → renew* → release | expire
    LeaseClaims (prefill worker)  who may read them: offer → claim (once) | forget | expire

A decode worker presents the id (ClaimLease) and gets the blocks' ids back, once, while the
lease lives; it never takes block ids from its caller. While its request waits for the pull
(a busy decode worker, a slow link) it renews the lease (RenewLeases: the deadline moves to a
full time to live from now), so the lease ends at its release, or a time to live after the
last renewal of a decode worker that died or lost track of it, and in any case at the end of
its life (the prefill worker's --lease-max-life after its grant): renewals cannot pin blocks
for good. The claims table holds a lease only
while the core's lease is live: it is offered when the handoff reaches the worker, forgotten
before the worker sends the core a release, and dead from the core's own deadline on (one
monotonic clock host-wide).

Plain Python, no torch. Not thread-safe: one loop drives each table. Times are seconds on one
monotonic clock (time.monotonic()), passed in so that tests control them.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import secrets
import sys
from array import array
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tandem.errors import InvalidArgument


class LeaseTable:
    """Live leases, each a list of block ids with a deadline.

    A lease granted at `now` with `ttl_s` expires at `now + ttl_s`: `expire(t)` for any
    t >= that reclaims it. Releasing an unknown, already released or expired lease returns None
    and changes nothing: a late Release from a decode worker is normal, not an error.
    """

    def __init__(self) -> None:
        self._blocks: dict[str, tuple[int, ...]] = {}  # live leases
        self._deadline: dict[str, float] = {}  # live lease -> its deadline now
        self._end_of_life: dict[str, float] = {}  # live lease -> no renewal goes past this
        # (deadline, lease id), a min-heap. A released lease's entry, and a renewed lease's
        # earlier one, stays until its deadline passes and expire() pops it.
        self._deadlines: list[tuple[float, str]] = []
        self._refs: Counter[int] = Counter()  # block id -> live leases holding it

    def grant(self, block_ids: Iterable[int], ttl_s: float, now: float,
              max_life_s: float | None = None) -> str:
        """Pin `block_ids` until release or `now + ttl_s`; return the new lease's id. Renewals
        move the deadline, but never past `now + max_life_s` (None: no cap): whoever renews a
        lease cannot pin its blocks for good.

        Ids are 128 random bits (hex): unguessable, since whoever holds one can claim the
        lease's blocks; and a Release meant for a lease of an earlier run cannot match one of
        this run."""
        if not ttl_s > 0:
            raise InvalidArgument("ttl_s", f"must be > 0, got {ttl_s}")
        if max_life_s is not None and not max_life_s >= ttl_s:
            raise InvalidArgument("max_life_s", f"must be >= the time to live {ttl_s}, got "
                                  f"{max_life_s}")
        lease_id = secrets.token_hex(16)
        blocks = tuple(block_ids)
        self._blocks[lease_id] = blocks
        self._refs.update(blocks)
        self._deadline[lease_id] = now + ttl_s
        self._end_of_life[lease_id] = now + max_life_s if max_life_s is not None else math.inf
        heapq.heappush(self._deadlines, (now + ttl_s, lease_id))
        return lease_id

    def renew(self, lease_id: str, ttl_s: float, now: float) -> float | None:
        """Move a live lease's deadline to `now + ttl_s` (never earlier than it was, never past
        the end of its life); return the deadline, or None if the lease is not live (released,
        expired, unknown). The decode worker that claimed a lease renews it while its request
        waits for the pull, so a busy decode worker or a slow link does not cost the prompt
        its KV."""
        deadline = self._deadline.get(lease_id)
        if deadline is None or deadline <= now:
            return None
        wanted = min(now + ttl_s, self._end_of_life[lease_id])
        if wanted > deadline:
            deadline = self._deadline[lease_id] = wanted
            heapq.heappush(self._deadlines, (deadline, lease_id))
        return deadline

    def release(self, lease_id: str) -> list[int] | None:
        """End a lease; return its blocks for the caller to free, or None if it is not live."""
        blocks = self._blocks.pop(lease_id, None)
        if blocks is None:
            return None
        del self._deadline[lease_id], self._end_of_life[lease_id]
        self._unref(blocks)
        return list(blocks)

    def expire(self, now: float) -> list[list[int]]:
        """End every lease whose deadline is <= now; return their block lists, earliest
        deadline first."""
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, lease_id = heapq.heappop(self._deadlines)
            if self._deadline.get(lease_id) != deadline:
                continue  # released before its deadline, or renewed past it
            del self._deadline[lease_id], self._end_of_life[lease_id]
            blocks = self._blocks.pop(lease_id)
            self._unref(blocks)
            expired.append(list(blocks))
        return expired

    def blocks(self, lease_id: str) -> tuple[int, ...] | None:
        """A live lease's blocks, or None (released, expired, unknown). Safe to call from
        another thread than the one driving the table (one dict read): a lease, once gone,
        never comes back, so blocks read between two calls that both found it were pinned."""
        return self._blocks.get(lease_id)

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


def prompt_digest(token_ids: Sequence[int]) -> bytes:
    """BLAKE2b-128 of a prompt's token ids as uint32 little-endian: what binds a lease to the
    prompt it was prefilled for (a decode worker must not cache one prompt's KV as another's)."""
    tokens = array("I", token_ids)
    if sys.byteorder == "big":
        tokens.byteswap()
    return hashlib.blake2b(tokens.tobytes(), digest_size=16).digest()


def prefix_digest(token_ids: Sequence[int], cache_salt: str) -> bytes:
    """What binds a lease on a cached prefix (lent from a worker's prefix cache or host tier to
    a worker that computes the rest of the prompt) to its tokens and its cache_salt: the
    claimant compares it with its own prompt's and salt's, so a salted prefix is never served
    to another salt even by a caller that mixed them up. Never equal to a prompt_digest (its
    own personalization), so neither lease passes for the other."""
    tokens = array("I", token_ids)
    if sys.byteorder == "big":
        tokens.byteswap()
    salt = cache_salt.encode()
    h = hashlib.blake2b(digest_size=16, person=b"tandem-prefix")
    h.update(len(salt).to_bytes(8, "little") + salt)
    h.update(tokens.tobytes())
    return h.digest()


@dataclass(frozen=True)
class Claim:
    """What a lease's token opens: its blocks (in prompt order), the prompt they hold, and
    the core's deadline for them (time.monotonic())."""

    block_ids: tuple[int, ...]
    num_tokens: int
    prompt_digest: bytes
    deadline: float


@dataclass
class Held:
    """A claimed lease, as the claims table keeps it until its release or deadline: who
    claimed it (the caller's identity, "" where calls carry none) and how many blocks it pins."""

    holder: str
    num_blocks: int
    deadline: float


class LeaseClaims:
    """The prefill worker's gate on its leases' blocks: each offered lease can be claimed once,
    before its deadline; after a claim, a release (`forget`) or the deadline, its id opens
    nothing. Unknown, expired, forgotten and claimed ids are refused alike (None).

    A claimed lease is held by its claimer until its release or deadline: only that caller may
    renew it (a token that leaked does not keep blocks pinned for someone else), and the
    blocks each holder pins are counted (`pinned_by_holder`)."""

    def __init__(self) -> None:
        self._open: dict[str, Claim] = {}
        self._held: dict[str, Held] = {}
        # (deadline, lease id), a min-heap, swept as `offer` goes: an entry is stale once its
        # lease was claimed, renewed or forgotten, and is dropped when it comes up.
        self._deadlines: list[tuple[float, str]] = []

    def offer(self, lease_id: str, claim: Claim, now: float) -> None:
        self.expire(now)
        self._open[lease_id] = claim
        heapq.heappush(self._deadlines, (claim.deadline, lease_id))

    def claim(self, lease_id: str, now: float, holder: str = "") -> Claim | None:
        """The lease's blocks, once, while it lives; `holder` holds it from now on."""
        claim = self._open.pop(lease_id, None)
        if claim is None or claim.deadline <= now:
            return None
        self._held[lease_id] = Held(holder, len(claim.block_ids), claim.deadline)
        return claim

    def unclaimed(self, lease_id: str) -> bool:
        """Whether the lease is offered and not yet claimed (nobody may renew it)."""
        return lease_id in self._open

    def held_by(self, lease_id: str, holder: str, now: float) -> bool:
        """Whether `holder` claimed this lease and it lives (as far as its last deadline here
        says: the core's own table has the last word)."""
        held = self._held.get(lease_id)
        return held is not None and held.holder == holder and held.deadline > now

    def renewed(self, lease_id: str, deadline: float) -> None:
        held = self._held.get(lease_id)
        if held is not None and deadline > held.deadline:
            held.deadline = deadline
            heapq.heappush(self._deadlines, (deadline, lease_id))

    def forget(self, lease_id: str) -> None:
        """The lease is being released: its id opens nothing from now on."""
        self._open.pop(lease_id, None)
        self._held.pop(lease_id, None)

    def expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, lease_id = heapq.heappop(self._deadlines)
            claim = self._open.get(lease_id)
            if claim is not None and claim.deadline <= now:
                del self._open[lease_id]
            held = self._held.get(lease_id)
            if held is not None and held.deadline <= now:
                del self._held[lease_id]

    def pinned_by_holder(self, now: float) -> dict[str, int]:
        """Blocks pinned by live claimed leases, per holder (a block of two leases counts
        twice: each holds it)."""
        self.expire(now)
        pinned: dict[str, int] = {}
        for held in self._held.values():
            pinned[held.holder] = pinned.get(held.holder, 0) + held.num_blocks
        return pinned

    def __len__(self) -> int:
        return len(self._open)
