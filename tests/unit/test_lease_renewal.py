"""A decode worker renews the leases its engine core holds, once a third of the time each was
last given has passed, one RenewLeases call per prefill worker, and reports the new deadlines
to the core; a lease the prefill worker no longer has is not tried again; a failed call is
tried again a second later. Times are passed in (no clock is waited on)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem.decode_svc.handoff import CORE, LEASE_MARGIN_S, WORKER, HeldLease
from tandem.decode_svc.lease_renewal import RETRY_S, LeaseRenewal
from tandem.v1 import worker_pb2


class FakeStub:
    """A prefill worker's RenewLeases: `ttl_ms` for the tokens it knows, 0 for the others;
    `fail` makes the next call fail UNAVAILABLE."""

    def __init__(self, known: dict[str, int]) -> None:
        self.known = known
        self.calls: list[list[str]] = []
        self.fail = False

    async def RenewLeases(self, request, timeout=None):  # noqa: N802 - gRPC method name
        self.calls.append(list(request.lease_ids))
        if self.fail:
            self.fail = False
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), "connection refused")
        return worker_pb2.RenewLeasesResponse(
            ttl_ms=[self.known.get(i, 0) for i in request.lease_ids])


def _lease(address: str, token: str, renew_at: float, owner: str = CORE) -> HeldLease:
    return HeldLease(address, token, owner=owner, deadline=renew_at + 10.0, renew_at=renew_at)


@pytest.fixture
def setup():
    stubs = {"p1:1": FakeStub({"a": 30_000, "b": 30_000}), "p2:1": FakeStub({"c": 30_000})}
    held = {x.lease_id: x for x in (
        _lease("p1:1", "a", 5.0), _lease("p1:1", "b", 50.0),  # b not due yet
        _lease("p2:1", "c", 5.0), _lease("p2:1", "gone", 5.0),
        _lease("p1:1", "unclaimed", 0.0, owner=WORKER))}  # not the core's: never renewed
    reports: list[list[tuple[str, float]]] = []
    return LeaseRenewal(held, stubs.__getitem__, reports.append), held, stubs, reports


def test_due_leases_are_renewed_per_prefill_worker_and_reported(setup) -> None:
    renewal, held, stubs, reports = setup
    asyncio.run(renewal.renew_once(now=6.0))
    assert stubs["p1:1"].calls == [["a"]] and stubs["p2:1"].calls == [["c", "gone"]]
    got = dict(pair for report in reports for pair in report)
    assert set(got) == {"a", "c"}
    for token in "ac":  # a full 30 s from the round's start, the margin kept; renewed again
        assert got[token] == held[token].deadline == 6.0 + 30.0 - LEASE_MARGIN_S
        assert held[token].renew_at == pytest.approx(6.0 + 10.0)  # a third of 30 s on
    assert held["gone"].renew_at == float("inf") and renewal.lost == 1 and renewal.renewed == 2
    assert held["b"].renew_at == 50.0 and held["unclaimed"].renew_at == 0.0
    stubs["p1:1"].calls.clear()
    asyncio.run(renewal.renew_once(now=6.0))  # nothing due again until a third has passed
    assert stubs["p1:1"].calls == [] and len(reports) == 2


def test_a_failed_call_is_tried_again_without_moving_the_deadline(setup) -> None:
    renewal, held, stubs, reports = setup
    stubs["p1:1"].fail = True
    before = held["a"].deadline
    asyncio.run(renewal.renew_once(now=6.0))
    assert held["a"].deadline == before and held["a"].renew_at == 6.0 + RETRY_S
    assert not any(token == "a" for report in reports for token, _ in report)
    asyncio.run(renewal.renew_once(now=6.0 + RETRY_S))
    assert stubs["p1:1"].calls == [["a"], ["a"]] and held["a"].deadline > before


def test_the_loop_renews_what_is_due_at_once_and_goes_on_until_cancelled(setup) -> None:
    renewal, held, _, reports = setup

    async def main():
        task = asyncio.get_running_loop().create_task(renewal.run())
        while not reports:  # the first round, at once
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert {token for report in reports for token, _ in report} >= {"a", "c"}
    assert held["a"].renew_at > 5.0 and held["unclaimed"].renew_at == 0.0


def test_a_renewal_that_no_longer_moves_the_deadline_is_the_last() -> None:
    """Near the end of a lease's life (the prefill worker's --lease-max-life) a renewal gives
    back about the time the lease had: the lease keeps its deadline and is not renewed again,
    instead of asking sooner and sooner as its time runs out."""
    stubs = {"p:1": FakeStub({"capped": 12_000, "fresh": 30_000})}
    held = {x.lease_id: x for x in (_lease("p:1", "capped", 5.0), _lease("p:1", "fresh", 5.0))}
    held["capped"].deadline = 6.0 + 12.0 - LEASE_MARGIN_S  # what the lease has: its life's end
    reports: list[list[tuple[str, float]]] = []
    renewal = LeaseRenewal(held, stubs.__getitem__, reports.append)
    asyncio.run(renewal.renew_once(now=6.0))
    assert held["capped"].deadline == 6.0 + 12.0 - LEASE_MARGIN_S
    assert held["capped"].renew_at == float("inf")
    assert held["fresh"].renew_at == pytest.approx(6.0 + 10.0)  # renewed on as before
    asyncio.run(renewal.renew_once(now=16.5))
    assert stubs["p:1"].calls == [["capped", "fresh"], ["fresh"]]
