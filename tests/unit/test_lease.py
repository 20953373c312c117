"""Leases (kvtransfer/lease.py): the prefill core's LeaseTable (grant, renew, release, expire)
and the prefill worker's LeaseClaims (offer, claim once, forget), on times passed in; and the
prompt digest a claim is checked against."""

from __future__ import annotations

import pytest

from tandem.errors import InvalidArgument
from tandem.kvtransfer.lease import Claim, LeaseClaims, LeaseTable, prompt_digest


def test_lease_release_returns_exactly_its_blocks_once() -> None:
    table = LeaseTable()
    a = table.grant([5, 3, 9], ttl_s=30.0, now=100.0)
    b = table.grant([1], ttl_s=30.0, now=100.0)
    assert a != b and len(table) == 2 and a in table
    assert table.pinned_blocks() == 4
    assert table.release(a) == [5, 3, 9]
    assert table.release(a) is None  # a second release is ignored
    assert table.release("no-such-lease") is None
    assert len(table) == 1 and table.pinned_blocks() == 1 and a not in table
    assert table.release(b) == [1]
    assert len(table) == 0 and table.pinned_blocks() == 0


def test_lease_expires_at_its_deadline_and_a_late_release_is_ignored() -> None:
    table = LeaseTable()
    early = table.grant([0, 1], ttl_s=10.0, now=0.0)  # deadline 10
    late = table.grant([2], ttl_s=5.0, now=8.0)  # deadline 13
    gone = table.grant([3], ttl_s=1.0, now=0.0)  # deadline 1, released first
    assert table.release(gone) == [3]
    assert table.expire(now=9.999) == []
    assert table.expire(now=10.0) == [[0, 1]]
    assert table.release(early) is None  # D's Release after P reclaimed the blocks
    assert len(table) == 1 and table.pinned_blocks() == 1
    assert table.expire(now=100.0) == [[2]]
    assert table.release(late) is None
    assert table.expire(now=200.0) == [] and len(table) == 0


def test_a_renewed_lease_lives_a_full_ttl_from_its_last_renewal() -> None:
    table = LeaseTable()
    kept = table.grant([0, 1], ttl_s=10.0, now=0.0)  # deadline 10
    other = table.grant([2], ttl_s=10.0, now=0.0)
    assert table.renew(kept, ttl_s=10.0, now=4.0) == 14.0
    assert table.renew(kept, ttl_s=1.0, now=5.0) == 14.0  # never earlier than it was
    assert table.expire(now=10.0) == [[2]]  # the other, at its own deadline
    assert table.renew(other, ttl_s=10.0, now=10.0) is None  # expired: not brought back
    assert table.renew(kept, ttl_s=10.0, now=12.0) == 22.0
    assert table.expire(now=21.9) == [] and kept in table
    assert table.expire(now=22.0) == [[0, 1]]  # a time to live after its last renewal
    assert table.renew(kept, ttl_s=10.0, now=22.0) is None
    released = table.grant([3], ttl_s=10.0, now=30.0)
    assert table.release(released) == [3] and table.renew(released, 10.0, now=31.0) is None
    assert table.renew("no-such-lease", 10.0, now=31.0) is None
    assert table.expire(now=100.0) == [] and len(table) == 0 and table.pinned_blocks() == 0


def test_renewals_never_take_a_lease_past_its_life() -> None:
    """A lease granted with a longest life (the prefill worker's --lease-max-life) is renewed up
    to it and no further, then expires whatever its holder asks: renewing cannot pin blocks for
    good."""
    table = LeaseTable()
    kept = table.grant([0, 1], ttl_s=10.0, now=0.0, max_life_s=25.0)  # ends by 25 at the latest
    assert table.renew(kept, ttl_s=10.0, now=9.0) == 19.0
    assert table.renew(kept, ttl_s=10.0, now=18.0) == 25.0  # capped, not 28
    assert table.renew(kept, ttl_s=10.0, now=24.0) == 25.0  # no further
    assert table.expire(now=24.9) == [] and table.expire(now=25.0) == [[0, 1]]
    assert table.renew(kept, ttl_s=10.0, now=25.0) is None
    uncapped = table.grant([2], ttl_s=10.0, now=0.0)
    assert table.renew(uncapped, ttl_s=10.0, now=1000.0) is None  # expired at 10 all the same
    for bad in (9.9, 0.0):
        with pytest.raises(InvalidArgument):
            table.grant([3], ttl_s=10.0, now=0.0, max_life_s=bad)


def test_expire_returns_leases_earliest_deadline_first() -> None:
    table = LeaseTable()
    for blocks, ttl in (([7], 3.0), ([4, 6], 1.0), ([2], 2.0), ([9], 50.0)):
        table.grant(blocks, ttl_s=ttl, now=0.0)
    assert table.expire(now=3.0) == [[4, 6], [2], [7]]
    assert len(table) == 1


def test_pinned_blocks_counts_a_block_shared_by_two_leases_once() -> None:
    table = LeaseTable()
    a = table.grant([0, 1, 2], ttl_s=30.0, now=0.0)  # two requests sharing prefix blocks 0, 1
    table.grant([0, 1, 5], ttl_s=30.0, now=0.0)
    assert table.pinned_blocks() == 4
    assert table.release(a) == [0, 1, 2]
    assert table.pinned_blocks() == 3


def test_grant_copies_its_input_and_refuses_a_non_positive_ttl() -> None:
    table = LeaseTable()
    blocks = [1, 2]
    lease = table.grant(blocks, ttl_s=1.0, now=0.0)
    blocks.append(3)
    assert table.release(lease) == [1, 2]
    for ttl in (0.0, -1.0, float("nan")):
        with pytest.raises(InvalidArgument) as err:
            table.grant([1], ttl_s=ttl, now=0.0)
        assert err.value.field == "ttl_s"
    assert len({table.grant([], ttl_s=1.0, now=0.0) for _ in range(1000)}) == 1000


def test_lease_ids_are_128_random_bits() -> None:
    table = LeaseTable()
    ids = [table.grant([1], ttl_s=1.0, now=0.0) for _ in range(100)]
    assert all(len(bytes.fromhex(i)) == 16 for i in ids) and len(set(ids)) == 100


def test_a_lease_is_claimed_once_while_it_lives() -> None:
    claims = LeaseClaims()
    a = Claim((4, 1, 3), 40, prompt_digest(range(40)), deadline=10.0)
    claims.offer("a", a, now=0.0)
    claims.offer("b", Claim((2,), 5, b"", deadline=10.0), now=0.0)
    claims.offer("c", Claim((7,), 5, b"", deadline=5.0), now=0.0)
    assert claims.claim("a", now=9.9) == a
    assert claims.claim("a", now=9.9) is None  # claimed: never again
    assert claims.claim("no-such-lease", now=0.0) is None
    claims.forget("b")  # released before anyone claimed it
    assert claims.claim("b", now=1.0) is None
    assert claims.claim("c", now=5.0) is None  # the core reclaims the blocks at the deadline
    claims.offer("d", Claim((8,), 5, b"", deadline=20.0), now=6.0)
    claims.offer("e", Claim((9,), 5, b"", deadline=30.0), now=21.0)  # sweeps d
    assert len(claims) == 1 and claims.claim("e", now=29.0) is not None


def test_only_a_claimed_lease_counts_as_claimed() -> None:
    claims = LeaseClaims()
    claims.offer("a", Claim((1,), 4, b"", deadline=10.0), now=0.0)
    assert claims.unclaimed("a") and not claims.unclaimed("b")
    claims.claim("a", now=1.0)
    assert not claims.unclaimed("a")


def test_a_claimed_lease_is_held_by_its_claimer_and_counted() -> None:
    """The claims table keeps who claimed each lease until its release or deadline: only that
    caller may renew it (another one holding the token may not), and each holder's pinned
    blocks are counted, dropping leases released or past their deadline."""
    claims = LeaseClaims()
    for lease, blocks, deadline in (("a", (1, 2, 3), 10.0), ("b", (4,), 10.0), ("c", (5,), 10.0)):
        claims.offer(lease, Claim(blocks, 16 * len(blocks), b"", deadline=deadline), now=0.0)
    claims.claim("a", now=1.0, holder="spiffe://tandem/decode/decode0")
    claims.claim("b", now=1.0, holder="spiffe://tandem/decode/decode1")
    assert claims.held_by("a", "spiffe://tandem/decode/decode0", now=2.0)
    assert not claims.held_by("a", "spiffe://tandem/decode/decode1", now=2.0)
    assert not claims.held_by("c", "", now=2.0)  # offered, never claimed
    assert claims.pinned_by_holder(now=2.0) == {"spiffe://tandem/decode/decode0": 3,
                                                "spiffe://tandem/decode/decode1": 1}
    claims.renewed("a", deadline=40.0)
    claims.forget("b")  # released
    assert claims.pinned_by_holder(now=20.0) == {"spiffe://tandem/decode/decode0": 3}
    assert not claims.held_by("a", "spiffe://tandem/decode/decode0", now=40.0)
    assert claims.pinned_by_holder(now=40.0) == {}  # past its deadline: gone


def test_prompt_digest_binds_every_token_and_the_length() -> None:
    prompt = [1, 2, 3, 70000]
    assert prompt_digest(prompt) == prompt_digest(tuple(prompt)) and len(prompt_digest([])) == 16
    assert len({prompt_digest(p) for p in (prompt, prompt[:3], [1, 2, 3, 70001], [2, 1, 3, 70000],
                                           [*prompt, 0])}) == 5
