"""`tandem up --elastic`: a fixed fleet of workers on one host follows the planner's mix.

The router's planner (router_svc/planner.py) says how many prefill and decode workers it wants
(tandem:planner_desired_replicas{role} on its /metrics, once per window, counted by
tandem:planner_windows_total). One host has a fixed number of workers, so what is applied is
the planner's *share*: of F workers, prefill gets

    round(F x desired_prefill / (desired_prefill + desired_decode))

bounded to [min_prefill, F - 1]: at least one decode worker always; min_prefill is 0 when the
router's prefill fallback serves a fleet without prefill workers (decode workers prefill the
prompts themselves), else 1. A worker changes role when that number differs from the prefill
workers up and the role it would join is one the planner wants more of than there is (an idle
fleet, whose planner lowers both roles, keeps its split), for `windows` planner windows in a row in the same direction, one worker at a time
(cli/supervisor.py: drained, started again in its other role); the count starts again after
each change, so the next one is judged on windows that saw the new split.
"""

from __future__ import annotations

import logging
import math
import ssl
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

DESIRED = "tandem:planner_desired_replicas"
WINDOWS = "tandem:planner_windows"


@dataclass(frozen=True)
class Split:
    prefill: int
    decode: int


@dataclass(frozen=True)
class RoleChange:
    """One worker to move from one role to the other, and why."""

    from_role: str
    to_role: str
    reason: str


def wanted_prefill(desired: Split, fleet: int, min_prefill: int) -> int:
    """Prefill workers of a `fleet` of workers, in the planner's proportion (module docstring)."""
    total = desired.prefill + desired.decode
    share = desired.prefill / total if total > 0 else 0.0
    return min(fleet - 1, max(min_prefill, math.floor(fleet * share + 0.5)))


def decide(desired: Split, actual: Split, min_prefill: int) -> RoleChange | None:
    """The role change that brings `actual` one worker nearer the planner's share, if any."""
    fleet = actual.prefill + actual.decode
    want = wanted_prefill(desired, fleet, min_prefill)
    why = (f"planner wants {desired.prefill} prefill and {desired.decode} decode: of "
           f"{fleet} workers, {want} prefill and {fleet - want} decode, now {actual.prefill} "
           f"and {actual.decode}")
    # Only toward a role the planner wants more of than there is: a fleet idle or within its
    # targets (the planner lowering both roles) keeps its split.
    if want > actual.prefill and desired.prefill > actual.prefill:
        return RoleChange("decode", "prefill", why)
    if want < actual.prefill and desired.decode > actual.decode:
        return RoleChange("prefill", "decode", why)
    return None


class Hysteresis:
    """A role change once the same direction was decided `windows` windows in a row."""

    def __init__(self, windows: int) -> None:
        if windows < 1:
            raise ValueError(f"--elastic-windows must be >= 1, got {windows}")
        self.windows = windows
        self._direction: tuple[str, str] | None = None
        self._held = 0

    def observe(self, change: RoleChange | None) -> RoleChange | None:
        """One window's decision; the change to make now, if it has held long enough."""
        direction = (change.from_role, change.to_role) if change else None
        self._held = self._held + 1 if direction == self._direction else 1
        self._direction = direction
        if change is None or self._held < self.windows:
            return None
        self.reset()
        return change

    def reset(self) -> None:
        self._direction, self._held = None, 0


@dataclass(frozen=True)
class PlannerReading:
    windows: int  # windows the planner has decided so far
    desired: Split


def parse_metrics(text: str) -> PlannerReading | None:
    """The planner's gauges from a router's /metrics text; None when it runs no planner."""
    desired: dict[str, float] = {}
    windows = None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == DESIRED:
                desired[s.labels.get("role", "")] = s.value
            elif s.name == f"{WINDOWS}_total":
                windows = int(s.value)
    if windows is None or not {"prefill", "decode"} <= desired.keys():
        return None
    return PlannerReading(windows, Split(int(desired["prefill"]), int(desired["decode"])))


def fetch_metrics(url: str, timeout_s: float = 2.0, own_tls: bool = False) -> str:
    """The router's /metrics. `own_tls`: the router serves HTTPS with the certificate given to
    `tandem up`, made for its public name rather than the loopback address read here: this
    process's own child on 127.0.0.1, with nothing secret sent, so its certificate is not
    checked."""
    context = None
    if own_tls:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    with urllib.request.urlopen(url, timeout=timeout_s, context=context) as r:
        return r.read().decode()


class Elastic:
    """Reads the router's planner once per `check()` and asks the supervisor for a role change
    when the hysteresis says so. `check` runs where the supervisor's does (`tandem up`'s loop)."""

    def __init__(self, supervisor, metrics_url: str, windows: int = 3, min_prefill: int = 0,
                 say: Callable[[str], None] = print,
                 fetch: Callable[[str], str] = fetch_metrics) -> None:
        self.supervisor = supervisor  # cli.supervisor.Supervisor of an elastic stack
        self.metrics_url = metrics_url
        self.min_prefill = min_prefill
        self.hysteresis = Hysteresis(windows)
        self.say = say
        self.fetch = fetch
        self._last_window: int | None = None
        self._unreadable = False  # said once, until it reads again

    def check(self) -> RoleChange | None:
        """One look at the planner; the role change asked for, if any."""
        try:
            reading = parse_metrics(self.fetch(self.metrics_url))
        except (OSError, ValueError) as e:
            if not self._unreadable:
                self._unreadable = True
                self.say(f"elastic: cannot read the planner at {self.metrics_url} ({e})")
            return None
        self._unreadable = False
        if reading is None or reading.windows == self._last_window:
            return None  # no planner, or no new window since the last look
        self._last_window = reading.windows
        if self.supervisor.converting:
            self.hysteresis.reset()  # windows during a change saw neither split
            return None
        stack = self.supervisor.stack
        actual = Split(len(stack.workers("prefill")), len(stack.workers("decode")))
        change = self.hysteresis.observe(decide(reading.desired, actual, self.min_prefill))
        if change is not None:
            # The last of its role: the one started last, or the first of the fleet's order.
            name = stack.workers(change.from_role)[-1].name
            self.supervisor.convert(name, change.to_role, change.reason)
        return change
