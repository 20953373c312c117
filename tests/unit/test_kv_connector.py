"""The scheduler side of a KV handoff (engine/kv_connector.py), one connector per engine by
role: each owns a lease table (a held prompt's blocks, or a running sequence's lent for live
migration, go back to the pool once, at release or expiry, never at a renewal)."""

from __future__ import annotations

import pytest

from tandem.engine.block_pool import BlockPool
from tandem.engine.kv_connector import DecodeConnector, KVConnector, PrefillConnector, connector_for


def _connector(role: str, pool: BlockPool) -> KVConnector:
    return connector_for(role, pool, block_size=4, vocab_size=32, max_model_len=64)


def test_the_prefill_connector_owns_the_leases():
    pool = BlockPool(8, 4)
    conn = _connector("prefill", pool)
    assert isinstance(conn, PrefillConnector) and not conn.waiting and conn.poll() == []
    conn.ttl_s, conn.max_life_s = 10.0, 25.0
    a, b = pool.allocate(3), pool.allocate(2)
    lease_a, ttl = conn.hold(a, now=100.0)
    lease_b, _ = conn.hold(b, now=100.0)
    assert ttl == 10.0 and len(conn) == 2 and pool.num_free == 3
    assert conn.renew([lease_b, "unknown"], now=105.0) == [10.0, 0.0]
    assert conn.release(lease_a) and not conn.release(lease_a)  # once
    assert pool.num_free == 6 and len(conn) == 1
    assert conn.expire(now=114.0) == 0 and conn.expire(now=115.5) == 1  # renewed to 115
    assert pool.is_idle() and len(conn) == 0 and conn.renew([lease_b], now=116.0) == [0.0]


@pytest.mark.parametrize("role", ["decode", "both"])
def test_decode_connectors_lend_through_the_same_leases(role):
    """A decode worker lends a running sequence's blocks (live migration) under a lease of the
    same kind: the blocks' references pass to it and go back once, at release or expiry."""
    pool = BlockPool(8, 4)
    conn = _connector(role, pool)
    assert isinstance(conn, DecodeConnector) and len(conn) == 0
    assert not conn.release("L") and conn.renew(["L"]) == [0.0] and conn.expire() == 0
    blocks = pool.allocate(2)
    pool.incref(blocks)  # the running sequence's and the lease's
    lease, _ = conn.hold(blocks, now=0.0)
    pool.free(blocks)  # the sequence ends (moved away)
    assert len(conn) == 1 and pool.num_free == 6
    assert conn.release(lease) and pool.is_idle() and len(conn) == 0
    assert conn.start([]) == [] and conn.poll() == [] and conn.ordered([])
