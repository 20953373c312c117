"""A worker's prefix-cache events for its routers (the WatchKV call).

    engine core ── KVEvents after each step that changed the cache ──▶ KVEventHub (worker)
                                                                         │ keeps the set of
                                                                         │ cached hashes
    router ◀── WatchKV: the whole set (reset), then every change ────────┘

The hub mirrors the set the engine's prefix cache holds (one int per cached block), and the set
its host tier holds where it has one (engine/host_kv_tier.py), so a router
that subscribes late, or again after its call broke, starts from the truth rather than from the
changes it missed. A subscriber whose queue backs up past `max_pending` messages (a stalled
router) is cut off: its call ends RESOURCE_EXHAUSTED and it subscribes again, rather than the
worker holding an unbounded backlog for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from tandem.engine.serving.core_messages import KVEvents
from tandem.v1 import worker_pb2

SNAPSHOT_CHUNK = 65536  # hashes per message of the initial set (512 KiB on the wire)


class SubscriberLagged(Exception):
    """A subscriber fell `max_pending` messages behind and was cut off."""


class KVEventHub:
    def __init__(self, block_size: int, instance_id: str, max_pending: int = 4096,
                 host_tier_id: str = "") -> None:
        self.block_size = block_size
        self.instance_id = instance_id
        self.host_tier_id = host_tier_id  # a host-shared tier's id ("": none, or this worker's)
        self.max_pending = max_pending
        self.cached: set[int] = set()
        self.host: set[int] = set()  # hashes the host tier holds
        self._subscribers: list[asyncio.Queue] = []
        self._closed = False

    def adopt(self, other: KVEventHub) -> None:
        """Mirror what `other` mirrors, before any event reaches this hub: the worker changed
        role in place (runtime/role_switch.py), and its prefix cache and host tier with it."""
        self.cached, self.host = set(other.cached), set(other.host)

    def publish(self, events: KVEvents) -> None:
        """The engine core's changes, in its order (AsyncEngine.on_kv_events)."""
        self.cached.difference_update(events.removed)
        self.cached.update(events.stored)
        self.host.difference_update(events.host_removed)
        self.host.update(events.host_stored)
        if not self._subscribers:
            return
        msg = self._message(events.stored, events.removed, events.host_stored,
                            events.host_removed)
        for q in list(self._subscribers):
            if q.qsize() >= self.max_pending:
                self._subscribers.remove(q)
                q.put_nowait(SubscriberLagged())
            else:
                q.put_nowait(msg)

    async def watch(self) -> AsyncIterator[worker_pb2.WatchKVResponse]:
        """The whole cached set (first message reset = true), then every change until the
        caller leaves. Raises SubscriberLagged when the caller fell too far behind."""
        q: asyncio.Queue = asyncio.Queue()
        # Taken with no await in between: no change can fall between the set and the queue.
        snapshot, host = list(self.cached), list(self.host)
        self._subscribers.append(q)
        try:
            for i in range(0, max(1, len(snapshot), len(host)), SNAPSHOT_CHUNK):
                msg = self._message(snapshot[i:i + SNAPSHOT_CHUNK], [], host[i:i + SNAPSHOT_CHUNK])
                msg.reset = i == 0
                yield msg
            while not self._closed:
                item = await q.get()
                if item is None:  # closed: the worker is shutting down
                    return
                if isinstance(item, SubscriberLagged):
                    raise item
                yield item
        finally:
            if q in self._subscribers:
                self._subscribers.remove(q)

    async def close(self) -> None:
        """Shutting down: every WatchKV call ends now (they would hold the server's graceful
        stop for its whole grace period)."""
        self._closed = True
        for q in self._subscribers:
            q.put_nowait(None)

    def _message(self, stored: list[int], removed: list[int], host_stored: list[int] = (),
                 host_removed: list[int] = ()) -> worker_pb2.WatchKVResponse:
        return worker_pb2.WatchKVResponse(stored=stored, removed=removed, block_size=self.block_size,
                                          instance_id=self.instance_id, host_stored=host_stored,
                                          host_removed=host_removed,
                                          host_tier_id=self.host_tier_id)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)
