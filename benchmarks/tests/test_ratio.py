"""benchmarks/serving/ratio.py: the layout names it parses and the report it draws from the
runs' JSON (best layout per workload, goodput under stricter SLOs)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from benchmarks.serving import ratio

HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def test_ratio_layouts_and_report(tmp_path):
    assert ratio.derived_layouts(4) == ["1P3D", "2P2D", "3P1D", "4C"]
    assert ratio.derived_layouts(2) == ["1P1D", "2C"]
    lay = ratio.parse_layout("1P2D")
    assert lay.roles == ["prefill", "decode", "decode"] and lay.gpus == 3
    assert ratio.parse_layout("2c").roles == ["both", "both"]
    het = ratio.parse_layout("1Ptp2_2D")
    assert (het.gpus, het.devices("cuda"), het.label()) == (
        4, ["cuda:0", "cuda:2", "cuda:3"], "1P(TP2):2D")
    assert het.role_args() == {"prefill": ["--tensor-parallel-size", "2"]}
    het = ratio.parse_layout("2P1Dtp2")
    assert (het.devices("cuda"), het.label()) == (["cuda:0", "cuda:1", "cuda:2"], "2P:1D(TP2)")
    assert ratio.parse_layout("2Ctp2").devices("cuda") == ["cuda:0", "cuda:2"]
    for bad in ("2X", "1Ptp22D", "tp2C"):
        with pytest.raises(SystemExit):
            ratio.parse_layout(bad)

    def run_(rate, duration, ttft):
        rows = [{"ok": True, "ttft_ms": ttft, "itl_p90_ms": 1.0} for _ in range(4)]
        lat = {"p50": ttft, "p99": ttft}
        summary = {"rate": rate, "completed": 4, "num_requests": 4, "duration_s": duration,
                   "request_throughput": 4 / duration, "output_throughput": 40 / duration,
                   "ttft_ms": lat, "itl_ms": {"p50": 1.0, "p99": 1.0}, "goodput": 4 / duration,
                   "slo_attainment": 1.0,
                   "slo": {"ttft_ms": 10, "itl_ms": 10, "per_request_itl": "p90"}}
        return summary, rows

    # 1P1D carries more within a 10 ms TTFT (5 req/s at rate 4), but its TTFT there is 5 ms.
    for name, runs in (("1P1D", [run_(2.0, 2.0, 1.0), run_(4.0, 0.8, 5.0), run_("inf", 0.1, 9)]),
                       ("2C", [run_(2.0, 2.0, 1.0), run_(4.0, 1.0, 2.0)])):
        (tmp_path / f"layout-{name}.json").write_text(json.dumps({
            "layout": name, "card": "cpu", "model": "m",
            "workloads": {"prompt-heavy": [s for s, _ in runs]},
            "requests": {"prompt-heavy": [rows for _, rows in runs]}}))
    rep = ratio.report(tmp_path)
    assert rep["best"]["prompt-heavy"]["layout"] == "1P1D"  # rate inf's 40 req/s is no load
    assert len(rep["rows"]) == 5
    assert (tmp_path / "goodput-prompt-heavy.png").exists() == HAS_MPL
    strict = ratio.report(tmp_path, (3.0, 10.0, "p90"))
    assert strict["best"]["prompt-heavy"] == {"layout": "2C", "max_goodput": 4.0,
                                              "mean_goodput": 3.0}
