"""The planner: from the latencies the router observed and its workers' loads, how many prefill
and decode workers the model needs to meet its targets (`tandem router --planner-ttft
--planner-itl`). It exports them as tandem:planner_desired_replicas{role}, which a
HorizontalPodAutoscaler scales each Deployment on (deploy/k8s/autoscaling.yaml), and logs each
change of decision with its reason.

Each window (--planner-interval seconds) it reads the router's time-to-first-token and
inter-token-latency histograms, takes the chosen percentile of what arrived in the window (as
Prometheus' histogram_quantile does, linear within a bucket), and decides per role, prefill by
TTFT and decode by ITL:

    observed > target                   scale out: ceil(current * observed / target), at least
                                        one more (reason over_target)
    observed < --planner-low-water * target and nothing queued on that role's workers
                                        scale in by one (under_target)
    no request in the window            scale in by one (idle)
    otherwise                           hold (within_target)

always within [--planner-min-replicas, --planner-max-replicas]. One step in at a time, any
number out: a missed target costs users, a spare replica only money.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger(__name__)

TTFT_METRIC = "tandem:time_to_first_token_seconds"
ITL_METRIC = "tandem:inter_token_latency_seconds"


@dataclass(frozen=True)
class PlannerTargets:
    ttft_s: float  # the TTFT percentile to stay under
    itl_s: float  # the ITL percentile to stay under
    percentile: float = 0.9
    low_water: float = 0.5  # scale in below this share of a target
    min_replicas: int = 1
    max_replicas: int = 8

    def __post_init__(self) -> None:
        for flag, v in (("--planner-ttft", self.ttft_s), ("--planner-itl", self.itl_s)):
            if not v > 0:
                raise ValueError(f"{flag} must be > 0, got {v}")
        if not 0 < self.percentile < 1:
            raise ValueError(f"--planner-percentile must be in (0, 1), got {self.percentile}")
        if not 0 <= self.low_water < 1:
            raise ValueError(f"--planner-low-water must be in [0, 1), got {self.low_water}")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError("--planner-min-replicas must be >= 1 and <= --planner-max-replicas"
                             f", got {self.min_replicas} and {self.max_replicas}")


@dataclass(frozen=True)
class RoleLoad:
    """One role in one window: its latency percentile (None: no request), replicas up now and
    requests queued on them."""

    observed_s: float | None
    replicas: int
    queued: int = 0


@dataclass(frozen=True)
class RoleDecision:
    desired: int
    reason: str  # over_target | under_target | idle | within_target


def decide(load: RoleLoad, target_s: float, t: PlannerTargets) -> RoleDecision:
    """One role's desired replica count (the rule in the module docstring)."""
    current = max(load.replicas, t.min_replicas)
    if load.observed_s is None:
        desired, reason = current - 1, "idle"
    elif load.observed_s > target_s:
        desired = max(current + 1, math.ceil(current * load.observed_s / target_s))
        reason = "over_target"
    elif load.observed_s < t.low_water * target_s and load.queued == 0:
        desired, reason = current - 1, "under_target"
    else:
        desired, reason = current, "within_target"
    return RoleDecision(min(t.max_replicas, max(t.min_replicas, desired)), reason)


def plan(prefill: RoleLoad, decode: RoleLoad, t: PlannerTargets) -> dict[str, RoleDecision]:
    """Both roles' decisions: prefill by time to first token, decode by inter-token latency."""
    return {"prefill": decide(prefill, t.ttft_s, t), "decode": decide(decode, t.itl_s, t)}


# -- percentiles of a window, from a Prometheus histogram's cumulative buckets ---------------
Buckets = dict[float, float]  # upper bound (le) -> cumulative count


def quantile(q: float, buckets: Buckets) -> float | None:
    """The q-quantile of a histogram's counts (cumulative by upper bound), interpolated within
    its bucket as histogram_quantile does; None when it counts nothing. Past the last finite
    bound: that bound."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = le, count
    return lower


def window(now: Buckets, before: Buckets) -> Buckets:
    """The counts that arrived between two reads of the same histogram."""
    return {le: c - before.get(le, 0.0) for le, c in now.items()}


def read_buckets(registry: CollectorRegistry, name: str) -> Buckets:
    """A histogram's cumulative buckets as the registry holds them now (labels summed)."""
    out: Buckets = {}
    for family in registry.collect():
        if family.name != name:
            continue
        for s in family.samples:
            if s.name == f"{name}_bucket":
                le = float(s.labels["le"])
                out[le] = out.get(le, 0.0) + s.value
    return out


class Planner:
    """Runs the rule every `interval_s` over the router's own histograms and its WorkerSet's
    loads; owns the tandem:planner_desired_replicas gauge."""

    def __init__(self, targets: PlannerTargets, metrics_registry: CollectorRegistry,
                 workers, interval_s: float = 30.0) -> None:
        if not interval_s > 0:
            raise ValueError(f"--planner-interval must be > 0, got {interval_s}")
        self.targets = targets
        self.registry = metrics_registry
        self.workers = workers  # router_svc.workers.WorkerSet: replicas up and their queues
        self.interval_s = interval_s
        self.desired = Gauge("tandem:planner_desired_replicas", "Workers of each role the "
                             "planner wants, to meet --planner-ttft and --planner-itl (a "
                             "HorizontalPodAutoscaler scales on it)", ["role"],
                             registry=metrics_registry)
        # Windows decided so far: a reader of the gauge (`tandem up --elastic`) counts a
        # decision held over windows by this, however often it reads.
        self.windows = Counter("tandem:planner_windows", "Planner windows decided",
                               registry=metrics_registry)
        self._last = {name: read_buckets(metrics_registry, name)
                      for name in (TTFT_METRIC, ITL_METRIC)}
        self.decisions: dict[str, RoleDecision] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self.step()  # the gauges say something from the start
        self._task = asyncio.get_running_loop().create_task(self._run(), name="planner")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.step()

    def step(self) -> dict[str, RoleDecision]:
        """One window: read, decide, export, log what changed."""
        observed = {}
        for name in (TTFT_METRIC, ITL_METRIC):
            now = read_buckets(self.registry, name)
            observed[name] = quantile(self.targets.percentile, window(now, self._last[name]))
            self._last[name] = now
        roles = {role: self.workers.by_role(role) for role in ("prefill", "decode")}
        got = plan(RoleLoad(observed[TTFT_METRIC], len(roles["prefill"]),
                            _queued(roles["prefill"])),
                   RoleLoad(observed[ITL_METRIC], len(roles["decode"]),
                            _queued(roles["decode"])), self.targets)
        for role, d in got.items():
            self.desired.labels(role).set(d.desired)
            if self.decisions.get(role) != d:
                log.info("planner: %s workers %d -> %d desired (%s; p%g %s %s s, target %s s)",
                         role, len(roles[role]), d.desired, d.reason,
                         self.targets.percentile * 100,
                         "TTFT" if role == "prefill" else "ITL",
                         _fmt(observed[TTFT_METRIC if role == "prefill" else ITL_METRIC]),
                         self.targets.ttft_s if role == "prefill" else self.targets.itl_s)
        self.decisions = got
        self.windows.inc()
        return got


def _queued(workers: Iterable) -> int:
    return sum(w.queued for w in workers)


def _fmt(v: float | None) -> str:
    return "none" if v is None else f"{v:.3f}"


def replay(windows: Sequence[tuple[RoleLoad, RoleLoad]],
           targets: PlannerTargets) -> list[dict[str, RoleDecision]]:
    """The decisions over a recorded trace of windows, each window's replicas as the last
    decision left them (what the autoscaler would have made): for tests and what-ifs."""
    out: list[dict[str, RoleDecision]] = []
    replicas = {"prefill": windows[0][0].replicas, "decode": windows[0][1].replicas} \
        if windows else {}
    for p, d in windows:
        got = plan(RoleLoad(p.observed_s, replicas["prefill"], p.queued),
                   RoleLoad(d.observed_s, replicas["decode"], d.queued), targets)
        replicas = {role: r.desired for role, r in got.items()}
        out.append(got)
    return out
