"""benchmarks/serving/changing_mix.py: its phases and layouts as parsed, goodput per phase and
over the run from per-request rows, and the merged report's ratios (elastic against the best
static split and colocated workers), on the JSON its runs write."""

from __future__ import annotations

import json

import pytest

from benchmarks.serving import changing_mix as mix

SLO = (1000.0, 50.0, "p90")
PHASES = [{"name": "mixed", "workload": "sharegpt", "rate": 2.0, "seconds": 10.0},
          {"name": "prompt-heavy", "workload": "prompt-heavy", "rate": 2.0, "seconds": 10.0}]


def test_phases_and_layouts_parse():
    ph = mix.parse_phase("mixed@32:30")
    assert (ph.name, ph.workload, ph.rate, ph.seconds, ph.num_requests) == (
        "mixed", "sharegpt", 32.0, 30.0, 960)
    for bad in ("chat@1:2", "prompt-heavy@x:2", "prompt-heavy@2", "decode-heavy@0:5",
                "decode-heavy@inf:5"):
        with pytest.raises(SystemExit):
            mix.parse_phase(bad)
    el = mix.mix_layout("elastic", "cuda")
    assert (el.roles, el.devices, el.placement, el.kind) == (
        ["prefill", "prefill", "decode", "decode"], ["cuda:0", "cuda:1", "cuda:2", "cuda:3"],
        True, "elastic")
    assert mix.mix_layout("elastic:1P3D", "cpu").roles == ["prefill"] + ["decode"] * 3
    assert (mix.mix_layout("4C", "cuda").kind, mix.mix_layout("2P2D", "cuda").kind) == (
        "colocated", "static")
    assert mix.mix_layout("2P2D", "cuda", placement=True).label == "2P2D+placement"
    for bad in ("elastic:4C", "elastic:1Ptp2_2D"):
        with pytest.raises(SystemExit):
            mix.mix_layout(bad, "cuda")


def row(phase: int, sent: float, end: float, ttft: float = 100.0, itl: float = 10.0,
        ok: bool = True) -> dict:
    return {"phase": phase, "sent_s": sent, "end_s": end, "ok": ok, "ttft_ms": ttft,
            "itl_p90_ms": itl}


def run(label: str, kind: str, rows: list[dict]) -> dict:
    return {"label": label, "kind": kind, "phases": PHASES, "requests": rows, "card": "X",
            "model": "m", "startup_s": 1.0}


def test_goodput_per_phase_and_over_the_run():
    rows = [row(0, 0, 4), row(0, 1, 5, ttft=1500), row(0, 2, 3, itl=60), row(0, 3, 8),
            row(1, 10, 12), row(1, 11, 15, ok=False), row(1, 12, 20)]
    s = mix.summarize(run("2P2D", "static", rows), SLO)
    # mixed: 2 of 4 within both SLOs (one late first token, one slow stream), over 0..8 s
    assert (s["mixed"]["good"], s["mixed"]["span_s"]) == (2, 8)
    assert s["mixed"]["goodput"] == pytest.approx(0.25)
    assert s["mixed"]["attainment"] == pytest.approx(0.5)
    # prompt-heavy: a failed request is never good; 10..20 s
    assert s["prompt-heavy"]["goodput"] == pytest.approx(2 / 10)
    assert s["all"]["goodput"] == pytest.approx(4 / 20)
    # Stricter SLOs count fewer.
    assert mix.summarize(run("2P2D", "static", rows), (1000.0, 5.0, "p90"))["all"]["good"] == 0


def test_report_merges_layouts_and_compares_elastic(tmp_path, capsys):
    fast = [row(k // 4, k, k + 1) for k in range(8)]  # 8 good over 8 s
    slow = fast[:4] + [row(1, k, k + 1, ttft=2000) for k in range(4, 8)]  # 4 good
    runs = {"2P2D": run("2P2D", "static", slow), "3P1D": run("3P1D", "static", fast[:6]),
            "4C": run("4C", "colocated", slow[:5]),
            "elastic": {**run("elastic", "elastic", fast),
                        "role_changes": [{"worker": "decode1", "became": "prefill2",
                                          "asked_s": 3.0, "ended_s": 9.5, "done": True,
                                          "in_place": True, "drain_s": 0.12,
                                          "change_s": 0.31, "reason": "planner"}]}}
    for name, r in runs.items():
        (tmp_path / f"layout-{name}.json").write_text(json.dumps(r))
    (tmp_path / "layout-unfinished.json").write_text(json.dumps(
        {**run("1P3D", "static", []), "requests": None}))
    out = mix.report(tmp_path, SLO)
    rat = out["ratios"]
    # 3P1D: 6 good over 6 s beats 2P2D's 4 over 8 s; 4C: 4 good over 5 s.
    assert tuple(rat["best_static"]) == ("3P1D", pytest.approx(1.0))
    assert rat["elastic"]["elastic"]["vs_best_static"] == pytest.approx(1.0)
    assert rat["elastic"]["elastic"]["vs_colocated"] == pytest.approx(1.0 / 0.8)
    assert [r["label"] for r in out["rows"]] == ["2P2D", "3P1D", "4C", "elastic"]
    text = capsys.readouterr().out
    assert "1.25x colocated" in text and "decode1 -> prefill2" in text
    assert "in place in 0.31 s, drained in 0.12 s" in text
    assert json.loads((tmp_path / "report.json").read_text())["ratios"]["best_colocated"][0] == "4C"
    # Without SLOs given, the report takes those the runs stored: here stricter, none good.
    for name, r in runs.items():
        (tmp_path / f"layout-{name}.json").write_text(json.dumps(
            {**r, "slo": {"ttft_ms": 50.0, "itl_ms": 50.0, "per_request_itl": "p90"}}))
    strict = mix.report(tmp_path, (None, None, "p90"))
    assert strict["slo"]["ttft_ms"] == 50.0 and strict["ratios"]["best_static"][1] == 0.0
