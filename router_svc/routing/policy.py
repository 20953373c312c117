"""The routing seam: what a policy is given and what it answers, as plain data.

    request ─▶ RouteRequest {prompt, its block hashes, priority}
    workers ─▶ WorkerLoad per candidate {address, role, load, free blocks,
                                         leading prompt blocks it caches}
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
from dataclasses import dataclass
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
    num_running: int = 0  # requests its engine is running
    free_blocks: int = 0  # free KV blocks in its pool
    # How many leading blocks of the request's prompt its prefix cache holds. Filled only for a
    # policy that says `uses_prefix_cache` (it costs a walk of the prompt's hashes); else 0.
    cached_blocks: int = 0

    @property
    def queued(self) -> int:
        """Requests ahead of a new one there: this router's in flight plus the engine's queue."""
        return self.in_flight + self.num_waiting


class RoutingPolicy(ABC):
    """Picks the worker for each leg of a request. Registered by `name` in
    router_svc/routing/__init__.py, which is where `tandem router --routing-policy` finds it."""

    name: ClassVar[str]
    summary: ClassVar[str]  # one line for `tandem router --help`
    # Whether WorkerLoad.cached_blocks is filled in for this policy.
    uses_prefix_cache: ClassVar[bool] = False

    @abstractmethod
    def pick_prefill(self, request: RouteRequest, workers: Sequence[WorkerLoad]) -> WorkerLoad:
        """The prefill worker for the request, one of `workers` (never empty)."""

    @abstractmethod
    def pick_decode(self, request: RouteRequest, workers: Sequence[WorkerLoad]) -> WorkerLoad:
        """The worker that generates the request's tokens: a decode worker after a prefill, or
        a colocated (`both`) worker for the whole request. One of `workers` (never empty)."""
