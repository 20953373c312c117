"""A decode core's pulls over NIXL (engine/serving/kv_pulls.py, kvtransfer/nixl.py NixlPull), with real NIXL agents
over the loopback device: a pull is started and polled, lands exactly and settles its lease
once; one held in flight and cancelled (its request ended), or past its lease's deadline,
releases its transfer once and settles with the error; flush waits for pulls in flight; pulls
are posted oldest first, no more bytes in flight than the link moves in about a second.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from nixl_pools import gated_reader, local_blocks, needs_nixl, owner_pool

from tandem.engine.sequence import RemoteKV
from tandem.engine.serving.core_messages import LeasesRenewed, MapPool
from tandem.engine.serving.kv_pulls import KVPulls


def _lease(i: int, src: list[int], ttl: float = 60.0) -> RemoteKV:
    return RemoteKV("p:1", f"L{i}", time.monotonic() + ttl, tuple(src), (7,), (None,),
                    instance_id="inst")


@pytest.fixture
def core(nixl_endpoints, monkeypatch):
    """(KVPulls mapping a nixl pool of 48 blocks, that pool, the local pool, LeaseDones sent,
    the reader's Gated agent): the reader is this process's endpoint, as a decode core's."""
    from tandem.kvtransfer import nixl

    owner = nixl_endpoints()
    reader, gated = gated_reader(nixl_endpoints)
    gated.gate.set()  # transfers complete unless a test closes the gate
    monkeypatch.setattr(nixl, "_default", reader)
    reader.progress_thread = False
    sent: list = []
    with owner_pool(owner, 48, torch.float16) as pool:
        local = local_blocks(64)
        engine = SimpleNamespace(runner=SimpleNamespace(pool=local, device="cpu"),
                                 tp_group=None)
        kp = KVPulls(engine, SimpleNamespace(peers={}), SimpleNamespace(send=sent.append))
        kp.map(MapPool("p:1", pool.descriptor, "inst"))
        yield kp, pool, local, sent, gated
        kp.close()
    assert set(gated.released.values()) <= {1} and len(gated.released) == len(gated.made)


def _poll(pull, limit_s: float = 30.0) -> None:
    end = time.monotonic() + limit_s
    while not pull.done():
        assert time.monotonic() < end, "the pull never completed"


@needs_nixl
def test_a_pull_is_started_polled_and_settled_once(core) -> None:
    kp, pool, local, sent, _ = core
    src = [5, 6, 7, 30, 12]
    dst = [20, 21, 22, 50, 9]  # 3 runs
    kv = _lease(0, src)
    kp.hold(kv, "r0")
    pull = kp.pull(kv, src, dst)
    assert pull is not None and kp.pulls == [pull] and pull.outside and kp.in_stream(kv)
    _poll(pull)
    assert pull.done() and kp.pulls == []  # done stays done
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(local[d], pool.tensor[s])
    (done,) = sent
    assert (done.request_id, done.pulled, done.error, done.transport) == ("r0", True, None, "nixl")
    assert done.num_blocks == 5 and done.nbytes == 5 * pool.descriptor.block_bytes
    assert done.num_runs == 3 and done.seconds > 0
    assert (kp.blocks_pulled, kp.runs_pulled) == (5, 3)
    assert kp.pull(_lease(1, []), [], []) is None  # nothing to move: settled at once
    assert len(sent) == 1  # (lease 1 was never held: nothing to tell)


@needs_nixl
@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_pull_held_in_flight_ends_once_with_its_transfer_released(core, how) -> None:
    kp, pool, local, sent, gated = core
    gated.gate.clear()  # the READ looks in flight until the gate opens
    src, dst = [1, 2, 3], [40, 41, 42]
    kv = _lease(0, src, ttl=60.0 if how == "cancel" else 0.3)
    kp.hold(kv, "r0")
    pull = kp.pull(kv, src, dst)
    assert not pull.done() and len(gated.made) == 1
    if how == "cancel":
        pull.cancel()
        pull.cancel()  # once
        error = "RuntimeError: the request ended before its KV arrived"
    else:
        end = time.monotonic() + 30
        with pytest.raises(TimeoutError, match="deadline"):
            while not pull.done():
                assert time.monotonic() < end
        with pytest.raises(TimeoutError):
            pull.done()  # the same error again, nothing more
        error = "TimeoutError: the KV pull did not complete before the lease's deadline"
    (done,) = sent
    assert (done.request_id, done.error, done.nbytes) == ("r0", error, 0)
    assert gated.released == {0: 1} and kp.pulls == [] and kp.blocks_pulled == 0
    gated.gate.set()
    kv = _lease(1, src)
    kp.hold(kv, "r1")
    _poll(kp.pull(kv, src, dst))  # the next pull works
    assert sent[-1].error is None and torch.equal(local[41], pool.tensor[2])


@needs_nixl
def test_a_renewed_lease_is_pulled_past_the_deadline_its_claim_gave(core) -> None:
    """The worker renews a held lease (LeasesRenewed): the pull starts, and stays in flight,
    after the claim's deadline, and ends well; a lease not renewed is refused at that deadline;
    renewals of leases the core does not hold change nothing."""
    kp, pool, local, sent, gated = core
    src, dst = [7, 8], [30, 31]
    kv = _lease(0, src, ttl=-1.0)  # the claim's deadline has passed
    kp.hold(kv, "r0")
    stale = _lease(1, src, ttl=-1.0)
    kp.hold(stale, "r1")
    later = time.monotonic() + 120.0
    kp.renewed(LeasesRenewed(((kv.lease_id, later), ("not-held", later))))
    kp.renewed(LeasesRenewed(((kv.lease_id, later - 60.0),)))  # an older answer, late
    assert kp.deadline(kv) == later and kp.deadline(stale) == stale.deadline
    assert set(kp.renewed_deadlines) == {kv.lease_id}
    with pytest.raises(TimeoutError, match="lease ran out"):
        kp.pull(stale, src, dst)
    gated.gate.clear()
    pull = kp.pull(kv, src, dst)
    assert not pull.done()  # in flight past the claim's deadline: not failed
    gated.gate.set()
    _poll(pull)
    assert [(m.request_id, m.error is None) for m in sent] == [("r1", False), ("r0", True)]
    assert torch.equal(local[31], pool.tensor[8]) and kp.renewed_deadlines == {}


@needs_nixl
def test_flush_waits_for_pulls_in_flight(core) -> None:
    kp, pool, local, sent, _ = core
    pulls = []
    for i in range(3):
        src = [3 * i, 3 * i + 1]
        kv = _lease(i, src)
        kp.hold(kv, f"r{i}")
        pulls.append(kp.pull(kv, src, [10 + 2 * i, 11 + 2 * i]))
    kp.flush()
    assert kp.pulls == [] and [m.request_id for m in sent] == ["r0", "r1", "r2"]
    assert all(p.done() for p in pulls) and torch.equal(local[15], pool.tensor[7])


@needs_nixl
def test_pulls_are_posted_oldest_first_within_the_bytes_the_link_moves(core, monkeypatch):
    """With at most two blocks' bytes in flight (the link's last rate unknown), the first of
    three two-block pulls is posted and the others wait, in order, until it is done; with a
    rate that moves them all in the time allowed, all are posted at once."""
    from tandem.kvtransfer import nixl

    kp, pool, local, sent, gated = core
    block = pool.descriptor.block_bytes
    monkeypatch.setattr(nixl, "INFLIGHT_MIN", 2 * block)
    gated.gate.clear()
    pulls = []
    for i in range(3):
        kv = _lease(i, [2 * i, 2 * i + 1])
        kp.hold(kv, f"r{i}")
        pulls.append(kp.pull(kv, [2 * i, 2 * i + 1], [20 + 2 * i, 21 + 2 * i]))
    for _ in range(3):
        assert not any(p.done() for p in pulls)
    posted = [p.transfer.transfer is not None for p in pulls]
    assert len(gated.made) == 1 and posted == [True, False, False]
    gated.gate.set()
    for p in pulls:
        _poll(p)
    assert [m.request_id for m in sent] == ["r0", "r1", "r2"] and kp.pullers["nixl"].rate > 0
    assert torch.equal(local[25], pool.tensor[5])
    gated.gate.clear()
    kp.pullers["nixl"].rate = 6 * block / nixl.INFLIGHT_S
    later = []
    for i in range(3, 6):
        kv = _lease(i, [2 * i, 2 * i + 1])
        kp.hold(kv, f"r{i}")
        later.append(kp.pull(kv, [2 * i, 2 * i + 1], [20 + 2 * i, 21 + 2 * i]))
    assert not any(p.done() for p in later)
    assert all(p.transfer.transfer is not None for p in later) and len(gated.made) == 6
    gated.gate.set()
    for p in later:
        _poll(p)
