"""The rolling-restart probe's table (benchmarks/robustness/rolling_restart.py): a request counts
in every phase its life overlapped, in "no fault" when it overlapped none, and once in "all"."""

from __future__ import annotations

from benchmarks.robustness.rolling_restart import Outcome, Phase, tally


def test_a_request_counts_in_each_phase_its_life_overlapped():
    phases = [Phase("rolling", 10.0, 20.0), Phase("prefill", 25.0, 30.0)]
    outcomes = [Outcome(0, 1.0, 5.0, "whole"),  # before any phase
                Outcome(1, 8.0, 12.0, "whole"),  # sent before, finished during rolling
                Outcome(2, 19.0, 26.0, "cut"),  # across both phases
                Outcome(3, 21.0, 24.0, "failed"),  # between them
                Outcome(4, 29.0, 31.0, "different")]  # sent during prefill
    rows = {r["phase"]: r for r in tally(outcomes, phases)}
    assert list(rows) == ["no fault", "rolling", "prefill", "all"]
    assert (rows["no fault"]["requests"], rows["no fault"]["whole"],
            rows["no fault"]["failed"]) == (2, 1, 1)
    assert (rows["rolling"]["requests"], rows["rolling"]["whole"], rows["rolling"]["cut"]) \
        == (2, 1, 1)
    assert (rows["prefill"]["requests"], rows["prefill"]["cut"],
            rows["prefill"]["different"]) == (2, 1, 1)
    assert [rows["all"][k] for k in ("requests", "whole", "failed", "cut", "different")] \
        == [5, 2, 1, 1, 1]
    assert rows["all"]["latency_p50_s"] == 4.0  # of the whole ones: 4.0 and 4.0
