"""`prefix-affinity` (the default): send a prompt where its prefix is cached, unless that worker
is much busier than the least busy.

Prefill: among the workers no busier than the least busy one plus `balance_slack` requests
(WorkerLoad.queued), the one caching the longest prefix of the prompt; ties to the least busy.

Decode (and colocated): among the same near-least-busy workers, the one caching the longest
prefix of the prompt (a conversation's earlier turns, pulled or generated there: only the rest
is pulled); ties to the most free KV blocks per request it runs or has in flight, then to the
fewest in flight.

Ties left after that go to the first candidate in the router's order of workers.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.router_svc.routing.policy import RouteRequest, RoutingPolicy, WorkerLoad


class PrefixAffinity(RoutingPolicy):
    name = "prefix-affinity"
    summary = "where the prompt's longest prefix is cached, among the least busy workers"
    uses_prefix_cache = True

    def __init__(self, balance_slack: int = 4) -> None:
        if balance_slack < 0:
            raise ValueError(f"balance_slack must be >= 0, got {balance_slack}")
        self.balance_slack = balance_slack

    def near_least_busy(self, workers: Sequence[WorkerLoad]) -> list[WorkerLoad]:
        least = min(w.queued for w in workers)
        return [w for w in workers if w.queued - least <= self.balance_slack]

    def pick_prefill(self, request: RouteRequest, workers: Sequence[WorkerLoad]) -> WorkerLoad:
        return max(self.near_least_busy(workers), key=lambda w: (w.cached_blocks, -w.queued))

    def pick_decode(self, request: RouteRequest, workers: Sequence[WorkerLoad]) -> WorkerLoad:
        return max(self.near_least_busy(workers),
                   key=lambda w: (w.cached_blocks,
                                  w.free_blocks / (1 + w.in_flight + w.num_running),
                                  -w.in_flight))
