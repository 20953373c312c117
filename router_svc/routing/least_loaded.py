"""`least-loaded`: the least busy worker, blind to what workers cache. A baseline for prefix
affinity (the same workload under both shows what routing on caches buys), and a fit for
workloads whose prompts share nothing.

Each leg goes to a worker with the fewest requests ahead of a new one (WorkerLoad.queued);
among those, decode prefers the most free KV blocks. Workers still tied take turns, so that
requests arriving one at a time on an idle cluster spread over every worker instead of all
landing on the first.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.router_svc.routing.policy import RouteRequest, RoutingPolicy, WorkerLoad


class LeastLoaded(RoutingPolicy):
    name = "least-loaded"
    summary = "the least busy worker (ties in turn), blind to what workers cache"

    def __init__(self) -> None:
        self._turn = {"prefill": 0, "decode": 0}  # picks made so far, per kind of leg

    def pick_prefill(self, request: RouteRequest, workers: Sequence[WorkerLoad]) -> WorkerLoad:
        least = min(w.queued for w in workers)
        return self._in_turn("prefill", [w for w in workers if w.queued == least])

    def pick_decode(self, request: RouteRequest, workers: Sequence[WorkerLoad]) -> WorkerLoad:
        least = min(w.queued for w in workers)
        idle = [w for w in workers if w.queued == least]
        most = max(w.free_blocks for w in idle)
        return self._in_turn("decode", [w for w in idle if w.free_blocks == most])

    def _in_turn(self, leg: str, tied: list[WorkerLoad]) -> WorkerLoad:
        turn = self._turn[leg]
        self._turn[leg] = turn + 1
        return tied[turn % len(tied)]
