"""`prefix-affinity` (the default): send a prompt where its prefix is cached, unless that worker
is much busier than the least busy.

Prefill: among the workers no busier than the least busy one plus `balance_slack` requests
(WorkerLoad.queued), the one caching the longest prefix of the prompt; ties to the least busy.

Decode (and colocated): among the same near-least-busy workers, the one caching the longest
prefix of the prompt (a conversation's earlier turns, pulled or generated there: only the rest
is pulled); ties to the most free KV blocks per request on it (WorkerLoad.requests: this
router's in flight plus other routers' running), then to the fewest in flight.

Ties left after that go to the first candidate in the router's order of workers.

"Caching" counts a worker's host tier too (engine/host_kv_tier.py): a block it holds there
weighs HOST_HIT_WEIGHT of a block on its GPU. A host hit saves the block's prefill (or its pull
from the prefill worker) but costs a host-to-device copy of its KV and a fresh block in the
pool; a GPU hit costs neither. The copy is small beside the prefill it saves (a 16-token block
of an 8B GQA model is 2 MiB: ~40-80 us over PCIe 5, against ~0.3-1 ms of prefill for 16 tokens
when prefill batches are compute-bound), but taking a fresh block evicts another prefix under
pressure, and the copy shares PCIe with the KV handoff: half the worth of a GPU hit says
"cheaper than a prefill, dearer than a GPU hit" without a figure measured per card and model.
So a worker holding 10 blocks on GPU wins over one holding 10 in its tier; one holding 10 in
its tier wins over one holding 4 on GPU and nothing else, and over a cold one.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.router_svc.routing.policy import RouteRequest, RoutingPolicy, WorkerLoad

HOST_HIT_WEIGHT = 0.5  # a block in a host tier, in blocks on the GPU (see above)


def cached_score(w: WorkerLoad) -> float:
    """The prompt blocks a worker need not compute, a host-tier block at HOST_HIT_WEIGHT."""
    return w.cached_blocks + HOST_HIT_WEIGHT * w.host_blocks


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
        return max(self.near_least_busy(workers), key=lambda w: (cached_score(w), -w.queued))

    def pick_decode(self, request: RouteRequest, workers: Sequence[WorkerLoad]) -> WorkerLoad:
        return max(self.near_least_busy(workers),
                   key=lambda w: (cached_score(w),
                                  w.free_blocks / (1 + w.requests),
                                  -w.in_flight))
