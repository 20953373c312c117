"""The floors beside a throughput figure (benchmarks/lib/floors.py), on numbers worked by hand."""

from __future__ import annotations

import pytest

from benchmarks.lib.floors import Card, Model, floors


def test_floors_worked_by_hand():
    card = Card(matmul_tflops=1.0, copy_gbps=1.0)  # 1e12 FLOP/s; 1e9 bytes read per second
    model = Model(matmul_params=1_000_000, weight_bytes=10_000_000, layers=2, q_dim=4,
                  kv_bytes_per_token=100)
    # Two requests: (prompt 3, output 2) and (prompt 1, output 4).
    f = floors(card, model, [3, 1], [2, 4], ttft_s=[0.5, 0.1], duration_s=1.0)
    # Context sums: prompt 3 -> 1+2+3 = 6, its outputs see 3 and 4 -> 7; prompt 1 -> 1, its
    # outputs see 1, 2, 3, 4 -> 10. Total 24.
    flops = 2 * 1_000_000 * (3 + 2 + 1 + 4) + 4 * 2 * 4 * 24
    assert f["tflop"] == pytest.approx(flops / 1e12)
    assert f["compute_floor_s"] == pytest.approx(flops / 1e12)
    # Four steps at least (the longest output), weights once per step, plus the KV the decode
    # tokens read (7 + 10 token contexts of 100 bytes).
    assert f["bandwidth_floor_s"] == pytest.approx((4 * 10_000_000 + 17 * 100) / 1e9)
    # Batch-1 step: 10 ms. Request 0: its prefill (2e6 x 3 + 32 x 6 FLOPs) + 1 step; request 1:
    # both prefills + 3 steps: the slowest.
    p0 = 2 * 1_000_000 * 3 + 4 * 2 * 4 * 6
    p1 = 2 * 1_000_000 * 1 + 4 * 2 * 4 * 1
    assert f["batch1_step_floor_ms"] == pytest.approx(10.0)
    assert f["critical_path_s"] == pytest.approx((p0 + p1) / 1e12 + 0.03)
    assert f["critical_request"]["index"] == 1
    assert f["critical_request"]["measured_first_token_s"] == 0.1
    assert f["bound_by"] == "bandwidth"  # 40 ms of weights beats 30 ms of steps
    assert f["share_of_floor"] == pytest.approx(f["bandwidth_floor_s"] / 1.0)
    assert f["compute_sustained_s"] is None  # no held rate measured


def test_the_held_matmul_rate_times_the_same_flops_and_leaves_the_floor():
    model = Model(matmul_params=1_000_000, weight_bytes=10_000_000, layers=2, q_dim=4,
                  kv_bytes_per_token=100)
    burst = floors(Card(matmul_tflops=1.0, copy_gbps=1.0), model, [3, 1], [2, 4],
                   ttft_s=[0.5, 0.1], duration_s=1.0)
    held = floors(Card(matmul_tflops=1.0, copy_gbps=1.0, matmul_sustained_tflops=0.8), model,
                  [3, 1], [2, 4], ttft_s=[0.5, 0.1], duration_s=1.0)
    assert held["compute_sustained_s"] == pytest.approx(burst["compute_floor_s"] / 0.8)
    for key in ("compute_floor_s", "bandwidth_floor_s", "critical_path_s", "floor_s"):
        assert held[key] == burst[key]  # the floor stays what no run can beat
