"""Renewing the prefill leases a decode worker holds while their requests wait for the pull.

A lease lives for its prefill worker's time to live (--lease-ttl, 30 s by default), counted from
the prefill. A request may wait longer than that for its pull: behind others for blocks on a
busy decode worker, or behind other pulls on a link slower than the prompts arrive. So the
worker renews every lease its engine core holds once a third of the time the lease was last
given has passed, in one RenewLeases call per prefill worker, and tells the core the new
deadlines (its pulls give up only then). A decode worker that dies stops renewing, and its
leases end a time to live later; one that cannot reach a prefill worker tries again each round
until the lease's own deadline. No lease outlives its prefill worker's --lease-max-life: a
renewal that no longer moves the deadline is the last one.

    held leases (DecodeServicer._held) ── due ──▶ RenewLeases(tokens) at each prefill worker
        ttl_ms per token ──▶ lease.deadline, lease.renew_at ──▶ LeasesRenewed ──▶ engine core
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from tandem.decode_svc.handoff import CORE, LEASE_MARGIN_S, RENEW_AFTER, HeldLease, renew_time
from tandem.v1 import worker_pb2

log = logging.getLogger(__name__)

RENEW_TIMEOUT_S = 10.0  # one RenewLeases call
RETRY_S = 1.0  # after a failed call, the next try for its leases
MAX_SLEEP_S = 1.0  # the loop looks at newly held leases at least this often
MIN_SLEEP_S = 0.05
MAX_PER_CALL = 4096  # the prefill worker's limit (prefill_svc/server.py MAX_RENEWALS)


class LeaseRenewal:
    """Renews `held` (token -> HeldLease, the worker's table) at their prefill workers through
    `stub_for(address)`, reports the new deadlines with `report([(token, deadline)])`, and counts
    on `metrics` (runtime.metrics.Metrics: kv_lease_renewals, kv_leases_lost), if given."""

    def __init__(self, held: dict[str, HeldLease], stub_for: Callable[[str], Any],
                 report: Callable[[list[tuple[str, float]]], None], metrics: Any = None) -> None:
        self.held = held
        self.stub_for = stub_for
        self.report = report
        self.metrics = metrics
        self.renewed = 0  # leases renewed (ttl_ms > 0 back)
        self.lost = 0  # leases a prefill worker no longer had

    def due(self, now: float) -> dict[str, list[HeldLease]]:
        """The leases the core holds whose renewal time has come, by prefill worker."""
        by_address: dict[str, list[HeldLease]] = {}
        for lease in self.held.values():
            if lease.owner == CORE and lease.renew_at <= now:
                by_address.setdefault(lease.address, []).append(lease)
        return by_address

    async def renew_once(self, now: float | None = None) -> None:
        """Renew every lease that is due (one call per prefill worker, concurrently)."""
        now = time.monotonic() if now is None else now
        await asyncio.gather(*(self._renew(address, leases[i:i + MAX_PER_CALL], now)
                               for address, leases in self.due(now).items()
                               for i in range(0, len(leases), MAX_PER_CALL)))

    async def _renew(self, address: str, leases: list[HeldLease], sent: float) -> None:
        """One call; `sent`: the round's start (the lease's time counts from no later)."""
        try:
            resp = await self.stub_for(address).RenewLeases(
                worker_pb2.RenewLeasesRequest(lease_ids=[x.lease_id for x in leases]),
                timeout=RENEW_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.warning("renewing %d lease(s) at %s failed: %s (tried again in %.0f s)",
                        len(leases), address, e.code().name, RETRY_S)
            for lease in leases:
                lease.renew_at = sent + RETRY_S
            return
        if len(resp.ttl_ms) != len(leases):
            log.warning("prefill worker %s answered %d renewals for %d leases", address,
                        len(resp.ttl_ms), len(leases))
            for lease in leases:
                lease.renew_at = sent + RETRY_S
            return
        deadlines = []
        for lease, ttl_ms in zip(leases, resp.ttl_ms, strict=True):
            if not ttl_ms:  # gone there: the core finds out at the deadline it has
                lease.renew_at = float("inf")
                self.lost += 1
                continue
            granted = sent + ttl_ms / 1000 - LEASE_MARGIN_S
            # A renewal that hardly moved the deadline met the end of the lease's life (the
            # prefill worker's --lease-max-life): asking again would only come sooner and
            # sooner. The lease keeps the deadline it has.
            capped = granted - lease.deadline < ttl_ms / 1000 * RENEW_AFTER / 2
            lease.deadline = max(lease.deadline, granted)
            lease.renew_at = float("inf") if capped else renew_time(sent, ttl_ms)
            deadlines.append((lease.lease_id, lease.deadline))
        lost = len(leases) - len(deadlines)
        if deadlines:
            self.renewed += len(deadlines)
            self.report(deadlines)
        if lost:
            log.warning("%d lease(s) at %s had ended when renewed", lost, address)
        if self.metrics is not None:
            self.metrics.kv_lease_renewals.inc(len(deadlines))
            self.metrics.kv_leases_lost.inc(lost)

    async def run(self) -> None:
        """Renew what is due, then sleep until the next renewal (MIN_SLEEP_S to MAX_SLEEP_S)."""
        while True:
            try:
                await self.renew_once()
            except Exception:  # a bug here must not end renewals for good
                log.exception("lease renewal round failed")
            now = time.monotonic()
            nxt = min((x.renew_at for x in self.held.values() if x.owner == CORE),
                      default=now + MAX_SLEEP_S)
            await asyncio.sleep(min(MAX_SLEEP_S, max(MIN_SLEEP_S, nxt - now)))
