"""`tandem up --elastic`'s decision (cli/elastic.py) on plain data: the planner's share of a fixed
fleet, its bounds (a decode worker always; no prefill worker only with prefill fallback), the
hysteresis over planner windows, and the follower reading the router's /metrics text."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tandem.cli.elastic import (
    Elastic,
    Hysteresis,
    RoleChange,
    Split,
    decide,
    parse_metrics,
    wanted_prefill,
)


def direction(change: RoleChange | None) -> tuple[str, str] | None:
    return (change.from_role, change.to_role) if change else None


@pytest.mark.parametrize(("desired", "actual", "min_prefill", "want"), [
    (Split(3, 1), Split(1, 3), 0, ("decode", "prefill")),  # prompt-heavy: 3 of 4 prefill
    (Split(1, 3), Split(3, 1), 0, ("prefill", "decode")),  # decode-heavy
    (Split(2, 6), Split(1, 3), 0, None),  # the same share at another scale: hold
    (Split(1, 1), Split(2, 2), 0, None),
    (Split(2, 2), Split(1, 2), 0, ("decode", "prefill")),  # 1.5 of 3 rounds up
    (Split(1, 1), Split(1, 2), 0, None),  # idle (both lowered): prefill wants no more
    (Split(3, 2), Split(1, 2), 0, ("decode", "prefill")),  # TTFT missed, ITL within target
    (Split(8, 1), Split(3, 1), 0, None),  # a decode worker always stays
    (Split(8, 1), Split(1, 1), 1, None),
    (Split(1, 8), Split(1, 3), 0, ("prefill", "decode")),  # fallback covers no prefill worker
    (Split(1, 8), Split(1, 3), 1, None),  # without it, one prefill worker stays
    (Split(1, 8), Split(0, 4), 0, None),
])
def test_the_planners_share_of_a_fixed_fleet_within_bounds(desired, actual, min_prefill, want):
    assert direction(decide(desired, actual, min_prefill)) == want


def test_wanted_prefill_rounds_half_up_and_stays_in_bounds():
    assert wanted_prefill(Split(1, 1), 3, 0) == 2
    assert wanted_prefill(Split(1, 3), 2, 0) == 1  # 0.5 -> 1
    assert wanted_prefill(Split(1, 9), 4, 0) == 0
    assert wanted_prefill(Split(1, 9), 4, 1) == 1
    assert wanted_prefill(Split(9, 1), 4, 0) == 3
    assert wanted_prefill(Split(5, 0), 1, 0) == 0  # one worker: it decodes


def test_a_change_must_hold_for_n_windows_in_a_row_and_the_count_restarts_after():
    out = RoleChange("decode", "prefill", "")
    back = RoleChange("prefill", "decode", "")
    h = Hysteresis(3)
    assert [h.observe(c) for c in (out, out)] == [None, None]
    assert h.observe(out) is out  # the third window in a row
    assert h.observe(out) is None  # counting again from the change
    h = Hysteresis(3)
    assert [h.observe(c) for c in (out, out, None, out, out, back, out)] == [None] * 7
    assert h.observe(out) is None and h.observe(out) is out
    assert Hysteresis(1).observe(back) is back
    with pytest.raises(ValueError, match="--elastic-windows"):
        Hysteresis(0)


METRICS = """# HELP tandem:planner_desired_replicas Workers of each role
# TYPE tandem:planner_desired_replicas gauge
tandem:planner_desired_replicas{{role="prefill"}} {p}
tandem:planner_desired_replicas{{role="decode"}} {d}
# HELP tandem:planner_windows_total Planner windows decided
# TYPE tandem:planner_windows_total counter
tandem:planner_windows_total {w}
"""


def test_the_planner_is_read_from_the_routers_metrics_text():
    got = parse_metrics(METRICS.format(p=3.0, d=1.0, w=7.0))
    assert (got.windows, got.desired) == (7, Split(3, 1))
    assert parse_metrics("# nothing\nother_metric 1\n") is None  # a router without a planner


class FakeSupervisor:
    """What Elastic uses of a Supervisor: its stack's workers, whether a change is under way,
    and convert (recorded)."""

    def __init__(self, roles: list[str]) -> None:
        self.names = [f"{r}{roles[:i].count(r)}" for i, r in enumerate(roles)]
        self.stack = SimpleNamespace(workers=lambda role: [
            SimpleNamespace(name=n) for n in self.names if n.rstrip("0123456789") == role])
        self.converting = False
        self.asked: list[tuple[str, str]] = []

    def convert(self, name: str, role: str, reason: str) -> None:
        self.asked.append((name, role))


def test_the_follower_counts_windows_not_reads_and_changes_one_worker():
    sup = FakeSupervisor(["prefill", "decode", "decode"])
    text = {"now": METRICS.format(p=2, d=1, w=1)}
    said: list[str] = []
    e = Elastic(sup, "http://127.0.0.1:1/metrics", windows=2, say=said.append,
                fetch=lambda url: text["now"])
    assert e.check() is None
    assert e.check() is None and sup.asked == []  # the same window read again: not counted
    text["now"] = METRICS.format(p=2, d=1, w=2)
    change = e.check()
    assert direction(change) == ("decode", "prefill") and "of 3 workers, 2 prefill" in \
        change.reason
    assert sup.asked == [("decode1", "prefill")]
    # While a change is under way, windows count for nothing.
    sup.converting = True
    for w in (3, 4, 5):
        text["now"] = METRICS.format(p=2, d=1, w=w)
        assert e.check() is None
    assert len(sup.asked) == 1
    # An unreadable router is said once, and the follower goes on.
    e.fetch = lambda url: (_ for _ in ()).throw(OSError("refused"))
    assert e.check() is None and e.check() is None
    assert len([s for s in said if "cannot read" in s]) == 1
