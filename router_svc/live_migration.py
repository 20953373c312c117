"""Live migration of one request between decode workers, as the router drives it.

    source D1 (drains)                 router                           destination D2
    ──────────────────                 ──────                           ──────────────
    move + lease on the KV  ───────▶  pick D2; DecodeRequest(kv: D1's
    written so far (K tokens)          lease, role decode; the tokens
    decodes on, tokens  ───────────▶   the client has) ─────────────────▶ claims, pulls K
    stream to the client               still streams D1's tokens         tokens' KV, parks
                                       ◀──────────────────────────────── ready
                                       HandOver(tokens streamed since) ─▶ records them,
    cancelled (a step boundary) ◀───── stops reading D1                   recomputes the KV
                                       streams D2's tokens ◀──────────── past K, samples on

The router is the one place that knows what the client has, so it picks the switch point: the
tokens it read from D1 when D2 says ready. Tokens D1 made after that are dropped unread (D2
makes the same ones: greedy and seeded samples depend only on the tokens before them, the
seed, the sample index and the position), so the stream never repeats or skips a token.

If D2 cannot pull (refused, lease expired, a layout it cannot map: any failure before ready),
a drain's request moves by token replay instead (decode_legs.DrainMove), and D1 decoded on
meanwhile; a rebalance's or an operator's (D1's Move: one request, D1 not draining) stays on D1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from opentelemetry import trace

from tandem.router_svc.worker_stream import Update, until_done
from tandem.router_svc.workers import Worker
from tandem.runtime.request_trace import client_call
from tandem.v1 import worker_pb2

log = logging.getLogger(__name__)


class Handed(Exception):
    """The request was handed over to `move.dst`: its leg on the source ends here and the next
    leg reads the destination's call, already open."""

    def __init__(self, move: LiveMove) -> None:
        super().__init__(f"handed over to {move.dst.address}")
        self.move = move


class LiveMove:
    """One live migration from its lease to the switch (or to its failure). Owns the call's
    request on the destination until the switch hands it to the next leg (`updates`).
    `legs`: the request's DecodeLegs (router_svc/decode_legs.py, which imports this module):
    its outputs so far, parameters, trace context and orchestrator."""

    def __init__(self, legs: Any, src: Worker, dst: Worker,
                 kv: worker_pb2.KVLocation, request_id: str, cause: str = "drain",
                 reason: str = "") -> None:
        self.legs, self.src, self.dst, self.kv = legs, src, dst, kv
        self.request_id = request_id
        # Why it moves: drain (its worker leaves), rebalance (its worker's pool is nearly
        # full, `reason` says how: router_svc/rebalance.py), or operator (its worker's Move).
        self.cause, self.reason = cause, reason
        # What the client had when the request was sent: HandOver carries what came after.
        self.sent = [len(out) for out in legs.outputs]
        self._stack = contextlib.ExitStack()
        self.traced = self._stack.enter_context(client_call(
            "/tandem.v1.Worker/Stream", dst.address, legs.ctx, getattr(legs.orch, "tracer", None),
            name="decode_leg", **{"tandem.worker.role": "decode", "tandem.request_id": request_id,
                                  "tandem.migration.source": src.address}))
        req = legs.decode_request(request_id)
        req.kv.CopyFrom(kv)
        self.call = dst.stream.request(worker_pb2.StreamRequest(decode=req),
                                       self.traced.metadata,
                                       legs.orch.remaining(legs.deadline))
        self.updates: AsyncIterator[Update] = until_done(self.call, legs.params.n, legs.done)
        dst.in_flight += 1
        self._counted = True
        self.ready = asyncio.ensure_future(self._ready())
        self.error: BaseException | None = None
        # When the destination's ready came (time.monotonic()): the switch is timed from it,
        # to its first update after the HandOver (`first_update`).
        self.ready_at = 0.0
        self._first_seen = False

    async def _ready(self) -> bool:
        """Whether the destination pulled the KV (its first update says so); False if it
        failed first (the reason in `error`)."""
        try:
            update = await anext(self.updates)
        except (grpc.aio.AioRpcError, StopAsyncIteration) as e:
            self.error = e
            return False
        if not update.ready:
            self.error = RuntimeError("the destination answered before its pull")
            return False
        self.ready_at = time.monotonic()
        return True

    def hand_over(self) -> bool:
        """Send the destination the tokens the client got since the request went out: from
        here it decodes the request. False when its call ended (the leg then fails there)."""
        tokens = [worker_pb2.SampleTokens(token_ids=out[n:])
                  for out, n in zip(self.legs.outputs, self.sent, strict=True)]
        msg = worker_pb2.StreamRequest(handover=worker_pb2.HandOver(
            request_id=self.request_id, tokens=tokens))
        sent = self.dst.stream.send(self.request_id, msg)
        made = sum(len(t.token_ids) for t in tokens)
        attrs = {"tandem.worker": self.src.address, "tandem.worker.to": self.dst.address,
                 "tandem.kv.num_tokens": self.kv.num_tokens, "tandem.handover.tokens": made,
                 "tandem.tokens_so_far": sum(len(out) for out in self.legs.outputs),
                 "tandem.move.cause": self.cause}
        if self.reason:
            attrs["tandem.rebalance.reason"] = self.reason
        trace.get_current_span(self.legs.ctx).add_event("live_migrated", attrs)
        self.legs.orch.workers.metrics.live_migrations.labels("handed_over").inc()
        # The switch's timing on this host's monotonic clock, as the destination logs the rest
        # (engine/migration.py Resumed): benchmarks/serving/migration_stall.py reads both.
        timing = {"ready": self.ready_at, "handover_sent": time.monotonic(),
                  "tokens_so_far": attrs["tandem.tokens_so_far"], "handed_over": made}
        log.info("moved %s live from %s to %s (%s; %d tokens' KV pulled, %d handed over) "
                 "timing=%s", self.legs.rid, self.src.address, self.dst.address, self.cause,
                 self.kv.num_tokens, made, json.dumps(timing, separators=(",", ":")))
        return sent

    def first_update(self) -> None:
        """The destination's first update after the HandOver is here (its first tokens): the
        switch's last timed moment on this side, logged once."""
        if not self._first_seen:
            self._first_seen = True
            timing = {"router_first_token": time.monotonic()}
            log.info("first update of %s from %s after its HandOver timing=%s", self.legs.rid,
                     self.dst.address, json.dumps(timing, separators=(",", ":")))

    async def abandon(self) -> None:
        """The move is off (failed, or the request ended first): the destination's request is
        cancelled there (its pull, if any, released to the source)."""
        self.ready.cancel()
        with contextlib.suppress(BaseException):
            await self.ready
        with contextlib.suppress(BaseException):
            await self.updates.aclose()
        with contextlib.suppress(BaseException):
            await self.call.aclose()
        self.close()

    def close(self) -> None:
        if self._counted:
            self._counted = False
            self.dst.in_flight -= 1
            self._stack.close()
