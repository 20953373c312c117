"""The routing seam: what a policy is given and what it answers, as plain data.

    request ─▶ RouteRequest {prompt, its block hashes, priority}
    workers ─▶ WorkerLoad per candidate {address, role, load, free blocks,
                                         leading prompt blocks it caches,
                                         on GPU and in a host tier}
                       │
              RoutingPolicy.pick_prefill / pick_decode
                       │
                       ▼
               one of the candidates

The router's WorkerSet (router_svc/workers.py) keeps the bookkeeping (channels, health,
membership, the KV events behind `cached_blocks`): it hands a policy the healthy candidates of
one role, never an empty list, and routes to the one it returns. A policy holds no channel and
no lock; it may keep state of its own (a turn counter), touched on the event loop only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import ClassVar


@dataclass(frozen=True)
class RouteRequest:
    """What a policy knows of the request."""

    prompt: Sequence[int]  # token ids
    # The chained hashes of the prompt's full blocks, as the workers key their prefix caches
    # (cache_salt included: another tenant's blocks never match).
    block_hashes: Sequence[int] = ()
    # The request's class: admission order under load, lower first (SamplingParams.priority).
    priority: int = 0


@dataclass(frozen=True)
class WorkerLoad:
    """One candidate worker as a policy sees it."""

    address: str
    role: str  # prefill | decode | both
    in_flight: int = 0  # this router's requests on the worker now
    num_waiting: int = 0  # requests queued in the worker's engine (its last answered poll)
    num_running: int = 0  # requests its engine is running (its last answered poll)
    free_blocks: int = 0  # free KV blocks in its pool
    # How many leading blocks of the request's prompt its prefix cache holds. Filled only for a
    # policy that says `uses_prefix_cache` (it costs a walk of the prompt's hashes); else 0.
    cached_blocks: int = 0
    # How fast it steps lately (Load.step_seconds, Load.prompt_token_seconds; 0: not yet known)
    step_seconds: float = 0.0
    prompt_token_seconds: float = 0.0
    # Its KV pulls so far (decode role; 0: none yet): bytes per second and bytes per block.
    kv_bandwidth: float = 0.0
    kv_block_bytes: int = 0
    # How many blocks of the prompt past those it can copy back from a host tier (its own, or
    # the one the workers of its host share) instead of computing them. Filled like
    # cached_blocks.
    host_blocks: int = 0
    # Prompt tokens this router sent the worker to prefill itself that have no first token yet
    # (a decode worker's own prefills: placement or fallback).
    local_prefill_tokens: int = 0
    # Other routers' requests it runs and queues, as its last poll counted them less this
    # router's in flight then (router_svc.workers.Worker.polled).
    other_running: int = 0
    other_waiting: int = 0

    @property
    def queued(self) -> int:
        """Requests ahead of a new one there: this router's in flight, exact, plus other
        routers' waiting as its last poll counted them (the poll's own waiting count lags and
        holds this router's too: a queue that has drained since would still weigh, twice)."""
        return self.in_flight + self.other_waiting

    @property
    def requests(self) -> int:
        """Requests on it now: this router's in flight, exact, plus other routers' running as
        its last poll counted them (the poll's own running count lags: a burst that ended since
        would still weigh)."""
        return self.in_flight + self.other_running


DISAGGREGATED = "disaggregated"  # prefilled on a prefill worker, decoded on a decode worker
LOCAL = "decode"  # the whole request on its decode worker (it prefills the prompt itself)


@dataclass(frozen=True)
class PlacementInputs:
    """What the rule weighed (seconds, tokens, blocks), for the trace."""

    slo_class: str
    prompt_tokens: int
    uncached_prefill_tokens: int
    uncached_decode_tokens: int
    host_blocks_p: int  # blocks each worker copies back from a host tier instead of computing
    host_blocks_d: int
    pull_blocks: int
    transfer_s: float
    disaggregated_s: float
    local_s: float
    harm_local_s: float
    harm_disaggregated_s: float
    weight: float


@dataclass(frozen=True)
class Placement:
    where: str  # DISAGGREGATED | LOCAL
    reason: str  # short | unmeasured | cheaper_local | cheaper_disaggregated
    inputs: PlacementInputs | None = None  # None: decided before any cost was weighed

    @property
    def local(self) -> bool:
        return self.where == LOCAL

    def attributes(self) -> dict[str, str | int | float]:
        """Span attributes: the decision and every input it weighed."""
        attrs: dict[str, str | int | float] = {"tandem.placement": self.where,
                                               "tandem.placement.reason": self.reason}
        if self.inputs is not None:
            attrs.update({f"tandem.placement.{k}": v for k, v in asdict(self.inputs).items()})
        return attrs


class RoutingPolicy(ABC):
    """Picks the worker for each leg of a request. Registered by `name` in
    router_svc/routing/__init__.py, which is where `tandem router --routing-policy` finds it."""

    name: ClassVar[str]
    summary: ClassVar[str]  # one line for `tandem router --help`
    # Whether WorkerLoad.cached_blocks is filled in for this policy.
    uses_prefix_cache: ClassVar[bool] = False
    # Whether it places requests (place): else every disaggregated request is prefilled on a
    # prefill worker, while one is up.
    places: ClassVar[bool] = False

    @abstractmethod
    def pick_prefill(self, request: RouteRequest, workers: Sequence[WorkerLoad]) -> WorkerLoad:
        """The prefill worker for the request, one of `workers` (never empty)."""

    @abstractmethod
    def pick_decode(self, request: RouteRequest, workers: Sequence[WorkerLoad]) -> WorkerLoad:
        """The worker that generates the request's tokens: a decode worker after a prefill, or
        a colocated (`both`) worker for the whole request. One of `workers` (never empty)."""

    def place(self, request: RouteRequest, prefill: WorkerLoad, decode: WorkerLoad,
              block_size: int) -> Placement:
        """Where a disaggregated request runs, given the prefill and decode workers this policy
        picked for it: prefilled on `prefill` and pulled by `decode`, or wholly on `decode`
        (router_svc/routing/placement.py). Called only when `places`."""
        return Placement(DISAGGREGATED, "policy")
