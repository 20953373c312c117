"""The planner (router_svc/planner.py) on plain data: each role's desired replicas from its
latency percentile against the target, replayed over a recorded trace of windows; percentiles
from a histogram's buckets as Prometheus computes them; the gauge it exports from a registry's
histograms."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Histogram

from tandem.router_svc.planner import (
    ITL_METRIC,
    TTFT_METRIC,
    Planner,
    PlannerTargets,
    RoleLoad,
    decide,
    plan,
    quantile,
    replay,
    window,
)

T = PlannerTargets(ttft_s=1.0, itl_s=0.05, percentile=0.9, min_replicas=1, max_replicas=6)


def test_over_target_scales_out_in_proportion_under_target_by_one():
    assert decide(RoleLoad(2.5, 2), 1.0, T) == decide(RoleLoad(2.5, 2), 1.0, T)
    assert decide(RoleLoad(2.5, 2), 1.0, T).desired == 5  # ceil(2 * 2.5)
    assert decide(RoleLoad(1.01, 2), 1.0, T).desired == 3  # at least one more
    assert decide(RoleLoad(9.0, 2), 1.0, T).desired == 6  # the maximum
    assert decide(RoleLoad(0.3, 3), 1.0, T).reason == "under_target"
    assert decide(RoleLoad(0.3, 3), 1.0, T).desired == 2
    assert decide(RoleLoad(0.3, 3, queued=4), 1.0, T).reason == "within_target"
    assert decide(RoleLoad(0.8, 3), 1.0, T).desired == 3
    assert decide(RoleLoad(None, 2), 1.0, T) == decide(RoleLoad(None, 2), 1.0, T)
    assert decide(RoleLoad(None, 1), 1.0, T).desired == 1  # the minimum


def test_prefill_follows_ttft_and_decode_follows_itl():
    got = plan(RoleLoad(3.0, 1), RoleLoad(0.01, 4), T)
    assert (got["prefill"].desired, got["prefill"].reason) == (3, "over_target")
    assert (got["decode"].desired, got["decode"].reason) == (3, "under_target")


# A recorded trace: (TTFT p90, prefill queued), (ITL p90, decode queued) per 30 s window,
# through chat (short prompts, many streams), summarization (long prompts, short answers) and
# agent turns (long contexts, long answers), then quiet.
TRACE = [
    ((0.4, 0), (0.030, 3)),    # chat: within both targets
    ((0.5, 1), (0.080, 12)),   # chat grows: ITL over
    ((0.6, 0), (0.045, 8)),    # held
    ((2.8, 9), (0.020, 0)),    # summarization burst: TTFT nearly 3x over
    ((1.2, 4), (0.020, 0)),    # still over, less
    ((0.7, 1), (0.018, 0)),    # within; decode idle-ish
    ((0.9, 0), (0.120, 20)),   # agents: long contexts slow decode steps
    ((0.3, 0), (0.040, 2)),
    ((None, 0), (None, 0)),    # quiet
    ((None, 0), (None, 0)),
]


def test_replayed_over_a_recorded_changing_mix():
    windows = [(RoleLoad(tp, 1, qp), RoleLoad(td, 2, qd)) for (tp, qp), (td, qd) in TRACE]
    got = [(d["prefill"].desired, d["prefill"].reason, d["decode"].desired, d["decode"].reason)
           for d in replay(windows, T)]
    assert got == [
        (1, "under_target", 2, "within_target"),
        (1, "within_target", 4, "over_target"),  # ceil(2 * 0.08 / 0.05)
        (1, "within_target", 4, "within_target"),
        (3, "over_target", 3, "under_target"),  # ceil(1 * 2.8)
        (4, "over_target", 2, "under_target"),
        (4, "within_target", 1, "under_target"),
        (4, "within_target", 3, "over_target"),  # ceil(1 * 0.12 / 0.05)
        (3, "under_target", 3, "within_target"),
        (2, "idle", 2, "idle"),
        (1, "idle", 1, "idle"),
    ]


def test_quantiles_as_histogram_quantile():
    buckets = {0.1: 0.0, 0.5: 50.0, 1.0: 90.0, 2.0: 100.0, math.inf: 100.0}
    assert quantile(0.5, buckets) == pytest.approx(0.5)
    assert quantile(0.9, buckets) == pytest.approx(1.0)
    assert quantile(0.95, buckets) == pytest.approx(1.5)
    assert quantile(0.25, buckets) == pytest.approx(0.3)
    assert quantile(0.9, {0.1: 0.0, math.inf: 0.0}) is None
    assert quantile(0.99, {1.0: 1.0, math.inf: 3.0}) == 1.0  # past the last finite bound
    assert window({1.0: 5.0, math.inf: 9.0}, {1.0: 2.0, math.inf: 3.0}) == {1.0: 3.0,
                                                                             math.inf: 6.0}


def test_the_planner_exports_desired_replicas_from_the_routers_histograms():
    reg = CollectorRegistry()
    buckets = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0)
    ttft = Histogram(TTFT_METRIC, "", ["role"], registry=reg, buckets=buckets).labels("router")
    itl = Histogram(ITL_METRIC, "", ["role"], registry=reg, buckets=buckets).labels("router")
    worker = SimpleNamespace(queued=0)
    workers = SimpleNamespace(by_role=lambda role: [worker] * (1 if role == "prefill" else 2))
    ttft.observe(100.0)  # before the planner started: not in its first window
    planner = Planner(T, reg, workers, interval_s=30)
    for _ in range(10):
        ttft.observe(2.0)  # 2 s, target 1 s
        itl.observe(0.03)  # within 0.05
    got = planner.step()
    assert (got["prefill"].desired, got["prefill"].reason) == (3, "over_target")
    assert got["decode"].reason == "within_target"
    desired = {s.labels["role"]: s.value for f in reg.collect() for s in f.samples
               if s.name == "tandem:planner_desired_replicas"}
    assert desired == {"prefill": 3, "decode": 2}
    assert planner.step()["prefill"].reason == "idle"  # nothing new in the next window
    windows = [s.value for f in reg.collect() for s in f.samples
               if s.name == "tandem:planner_windows_total"]
    assert windows == [2]  # counted, for a reader that must tell windows apart


def test_bad_targets_name_their_flag():
    for kw, flag in ((dict(ttft_s=0, itl_s=1), "--planner-ttft"),
                     (dict(ttft_s=1, itl_s=-1), "--planner-itl"),
                     (dict(ttft_s=1, itl_s=1, percentile=1.0), "--planner-percentile"),
                     (dict(ttft_s=1, itl_s=1, min_replicas=3, max_replicas=2),
                      "--planner-min-replicas")):
        with pytest.raises(ValueError, match=flag):
            PlannerTargets(**kw)
