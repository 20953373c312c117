"""The benchmarks run end to end on the CPU with a tiny Llama, each by its path as a user runs it:
serve.py against a stack it launches (colocated and disaggregated), serve.py --mode offline,
hf_baseline.py (static batches and transformers' continuous batching), router_intake.py (the
router alone, as two API processes), and the engine and robustness benchmarks' small versions. Each JSON must show every request completed with exactly
the workload's token counts. (The benchmarks' own helpers are tested in benchmarks/tests/.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
N = 8
WORKLOAD = ["--workload", "sharegpt", "--num-requests", str(N), "--sharegpt-max-len", "48",
            "--seed", "3"]
ENGINE = ["--", "--num-blocks", "256", "--max-num-batched-tokens", "64"]
HAS_MPL = importlib.util.find_spec("matplotlib") is not None


# The output tokens WORKLOAD asks for of the tiny models' 512-token vocabulary (its requests'
# max_tokens summed): fixed, so a change in how the benchmarks draw a workload shows here too.
EXPECTED_TOKENS = 344


def run(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs benchmarks/<script> by its path, as its docstring says to (the tests import nothing
    from benchmarks/)."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def check_latencies(s: dict) -> None:
    assert s["ttft_ms"]["n"] == N and 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"]
    assert 0 < s["tpot_ms"]["p50"] <= s["tpot_ms"]["p99"]
    assert s["output_throughput"] > s["request_throughput"] > 0


@pytest.mark.parametrize("launch", ["colocated", "disaggregated"])
def test_serve_launches_the_stack_and_counts_every_token(tiny_models, tmp_path, launch):
    out = tmp_path / "serve.json"
    layout = ["--num-prefill", "1", "--num-decode", "1"] if launch == "disaggregated" else []
    run("serving/serve.py", "--launch", launch, *layout, "--model", str(tiny_models["llama"]),
        "--devices", "cpu", "--dtype", "float32", *WORKLOAD, "--rate", "inf", "40",
        "--warmup", "2", "--client-procs", "2" if launch == "disaggregated" else "1",
        "--slo-ttft-ms", "60000", "--slo-itl-ms", "60000", "--cooldown", "0", "--no-progress",
        "--out", str(out), *ENGINE)
    r = json.loads(out.read_text())
    roles = [w["role"] for w in r["workers"]]
    assert roles == (["prefill", "decode"] if launch == "disaggregated" else ["both"])
    assert r["card"] == "cpu" and all(code == 0 for code in r["exit_codes"].values())
    assert [run["summary"]["rate"] for run in r["runs"]] == ["inf", 40.0]
    for run_ in r["runs"]:
        s = run_["summary"]
        assert s["completed"] == N and s["failed"] == 0, s["errors"]
        assert s["output_tokens"] == s["expected_output_tokens"] == EXPECTED_TOKENS
        assert [q["output_tokens"] for q in run_["requests"]] == \
            [q["expected_tokens"] for q in run_["requests"]]
        check_latencies(s)
        # One gap per token after the first (a chunk per token over gRPC).
        assert 0 < s["itl_ms"]["n"] <= s["output_tokens"] - N
        # SLOs of a minute: every request is good, so goodput is the request throughput.
        assert s["slo_attainment"] == 1.0
        assert s["goodput"] == pytest.approx(s["request_throughput"])
    assert out.with_suffix(".png").exists() == HAS_MPL
    if launch == "disaggregated":  # every prompt's blocks pulled, in at most as many copies
        k = r["kv_pulls"]
        assert 0 < k["runs"] <= k["blocks"] and k["bytes"] > 0 and k["seconds"] > 0
    else:
        assert "kv_pulls" not in r


def test_serve_offline_reports_kv_waste_against_static_batches(tiny_models, tmp_path):
    out = tmp_path / "offline.json"
    run("serving/serve.py", "--mode", "offline", "--model", str(tiny_models["llama"]), "--devices", "cpu",
        "--dtype", "float32", *WORKLOAD, "--static-batch-size", "8", "--no-progress",
        "--out", str(out), *ENGINE)
    r = json.loads(out.read_text())
    assert r["completed"] == N and not r["wrong_length"]
    assert r["output_tokens"] == r["expected_output_tokens"] == EXPECTED_TOKENS
    check_latencies(r)
    kv = r["kv"]
    assert 2 <= kv["peak_running_seqs"] <= N
    assert 0 <= kv["paged_waste"] < 1
    # Paged blocks waste at most a partial block per sequence; one static batch of all 8
    # requests reserves max prompt + max output for every row.
    assert kv["paged_waste"] < kv["static"]["reserved_waste"]
    assert kv["static"]["num_batches"] == 1
    st = r["step_time"]
    assert st["steps"] > 0 and 0 < st["outside_execute_share"] < 1
    # The step-time account: every step that ran a batch is of one kind, every token in one
    # of them (pipelined steps: the call that takes the last step's tokens runs none).
    kinds = st["by_kind"]
    assert sum(kinds[k]["steps"] for k in ("decode", "mixed", "prefill")) == \
        st["steps"] - st["calls_without_batch"]
    assert 0 <= st["calls_without_batch"] <= 2
    assert kinds["decode"]["steps"] > 0 and kinds["decode"]["tokens"] >= kinds["decode"]["steps"]
    assert kinds["prefill"]["steps"] + kinds["mixed"]["steps"] > 0
    total = sum(kinds[k]["tokens"] for k in ("decode", "mixed", "prefill"))
    assert total >= EXPECTED_TOKENS - N  # every output token but the first is a decode token
    # GPU busy time is measured on CUDA only.
    assert all(kinds[k]["profiled"] == 0 for k in ("decode", "mixed", "prefill"))


def test_hf_baseline_static_and_continuous_batching(tiny_models, tmp_path):
    out = tmp_path / "hf.json"
    run("serving/hf_baseline.py", "--model", str(tiny_models["llama"]), "--device", "cpu", "--mode",
        "both", *WORKLOAD, "--batch-size", "4", "--cb-num-blocks", "64", "--cb-block-size", "16",
        "--cb-max-batch-tokens", "128", "--no-progress", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["card"] == "cpu" and r["workload_stats"]["output_tokens"] == EXPECTED_TOKENS
    for mode in ("static", "cb"):
        s = r[mode]
        assert s["completed"] == N and not s["partial"], s
        assert s["output_tokens"] == EXPECTED_TOKENS
        check_latencies(s)
    assert r["static"]["batches"] == 2
    # Static rows decode their batch's longest output: more computed than asked for.
    assert r["static"]["computed_output_throughput"] > r["static"]["output_throughput"]


def test_hf_baseline_static_cache(tiny_models, tmp_path):
    """--cache static: generate with transformers' static cache (compiled on CUDA only), the
    first batch run once untimed; the same tokens counted."""
    out = tmp_path / "hf_static.json"
    run("serving/hf_baseline.py", "--model", str(tiny_models["llama"]), "--device", "cpu", "--mode",
        "static", "--cache", "static", *WORKLOAD, "--batch-size", "4", "--no-progress",
        "--out", str(out))
    s = json.loads(out.read_text())["static"]
    assert s["cache"] == "static" and s["completed"] == N and not s["partial"], s
    assert s["output_tokens"] == EXPECTED_TOKENS and s["batches"] == 2
    check_latencies(s)


def test_structured_benchmark_counts_every_token(tiny_models, tmp_path):
    """benchmarks/engine/structured.py on the CPU: both kinds decode every token, the grammar is
    compiled once, and the JSON names the card; pipelined steps (as on a GPU) with the
    breakdown's timers in place."""
    model = str(tiny_models["llama"])
    out = tmp_path / "structured.json"
    run("engine/structured.py", "--model", model, "--tokenizer", model, "--device", "cpu",
        "--dtype", "float32", "--num-requests", "3", "--prompt-len", "6", "--max-tokens", "12",
        "--rounds", "1", "--max-num-batched-tokens", "64", "--async-scheduling", "--breakdown",
        "--out", str(out), timeout=300)
    r = json.loads(out.read_text())
    assert r["card"] == "cpu" and r["requests"] == 3 and set(r["median"]) == {
        "unconstrained", "json_schema"} and r["pipelined"]
    assert r["ratio"] > 0


@pytest.mark.parametrize("schema", ["bounded", "unbounded"])
def test_grammar_step_benchmark_replays_every_variant(tiny_models, tmp_path, schema):
    """benchmarks/engine/grammar_step.py with the demo's tokenizer: every variant replays the same
    walks through the grammar (none breaks it) and the JSON names the machine and schema."""
    out = tmp_path / "grammar_step.json"
    run("engine/grammar_step.py", "--tokenizer", str(tiny_models["llama"]), "--rows", "2", "3",
        "--steps", "6", "--rounds", "2", "--schema", schema, "--out", str(out))
    r = json.loads(out.read_text())
    assert r["machine"] and r["steps"] == 6 and set(r["median"]) == {"2", "3"}
    assert r["schema"] == schema
    for by_variant in r["median"].values():
        assert set(by_variant) == {"serial", "batched", "engine"}
        assert all(m["step_us"] > 0 for m in by_variant.values())


def test_multiturn_moves_only_new_blocks_with_reuse(tiny_models, tmp_path):
    """benchmarks/serving/multiturn.py, reuse off then on: turn 2 pulls its whole prompt without reuse
    and only its new blocks with it; the outputs agree."""
    out = tmp_path / "multiturn.json"
    run("serving/multiturn.py", "--model", str(tiny_models["llama"]), "--num-prefill", "1",
        "--num-decode", "1", "--num-conversations", "2", "--turns", "2", "--first-tokens", "40",
        "--new-tokens", "20", "--output-tokens", "12", "--rate", "100", "--out", str(out),
        "--", "--num-blocks", "128", timeout=300)
    report = json.loads(out.read_text())
    off, on = report["runs"]["off"], report["runs"]["on"]
    assert off[0]["kv_blocks"] == on[0]["kv_blocks"] == 3  # 40 tokens: 3 blocks, both
    assert off[1]["kv_blocks"] == 5  # 72 tokens: the whole prompt again
    assert on[1]["kv_blocks"] == 5 - (40 + 12 - 1) // 16  # less what turn 1 computed there
    assert on[1]["computed"] == off[1]["computed"] == 72 - 32  # prefill reuses turn 1's blocks
    assert report["identical_outputs"] == [4, 4]


def test_cold_start_benchmark_runs_every_pass(tiny_models, tmp_path):
    """benchmarks/engine/cold_start.py on the CPU: four passes of prefill-only requests, each timed,
    and the Triton cache counted (empty here: the CPU runs no compiled kernels)."""
    out = tmp_path / "cold.json"
    cache = tmp_path / "triton"
    cache.mkdir()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine" / "cold_start.py"),
                           "--model", str(tiny_models["llama"]), "--device", "cpu",
                           "--dtype", "float32", "--load-format", "auto", "--max-model-len",
                           "256", "--long", "100", "--count", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "TRITON_CACHE_DIR": str(cache)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert [p["pass"][0] for p in r["passes"]] == ["A", "B", "C", "D"]
    assert r["passes"][0]["lengths"] == r["passes"][1]["lengths"]
    assert not set(r["passes"][0]["lengths"]) & set(r["passes"][2]["lengths"])
    assert all(len(p["ms"]) == 2 and min(p["ms"]) > 0 for p in r["passes"])
    assert r["card"] == "cpu" and r["passes"][0]["new_cache_entries"] == 0


def test_step_profile_times_every_step_kind(tmp_path):
    """benchmarks/engine/step_profile.py --smoke: each step kind of each variant run and timed (the
    CPU has no device times to split by kernel)."""
    out = tmp_path / "steps.json"
    proc = run("engine/step_profile.py", "--smoke", "--variants", "bf16", "--out", str(out), timeout=240)
    rows = json.loads(out.read_text())["bf16"]["rows"]
    assert [r["step"] for r in rows] == ["prefill 64", "mixed 20+4", "decode 1", "decode 4"]
    assert all(r["wall_ms"] > 0 for r in rows)
    assert "mixed 20+4" in proc.stdout


def test_flood_benchmark_counts_every_request(tmp_path):
    """benchmarks/robustness/flood.py end to end, small: `tandem up` with the demo model, two floods of 30
    requests (one kind each) from two client processes; every request OK, no worker failed
    over, the router's loop lag read."""
    out = tmp_path / "flood.json"
    run("robustness/flood.py", "--floods", "2", "--requests", "30", "--mix", "in-turn", "--clients", "2",
        "--burners", "0", "--out", str(out), timeout=240)
    r = json.loads(out.read_text())
    assert r["summary"]["ok"] == 60 and r["summary"]["failed"] == 0
    assert r["summary"]["failovers"] == 0
    assert [f["kinds"] for f in r["floods"]] == ["http", "http-stream"]
    assert all(f["longest_loop_stall_s"].startswith("<=") for f in r["floods"])


def test_router_intake_counts_every_token_through_two_api_processes(tiny_models, tmp_path):
    out = tmp_path / "intake.json"
    run("serving/router_intake.py", "--model", str(tiny_models["llama"]), "--num-requests", "24",
        "--output-len", "5", "--warmup", "4", "--step-ms", "2",
        "--router-arg=--api-processes=2", "--router-arg=--responses-store=0", "--out", str(out))
    (r,) = json.loads(out.read_text())["runs"]
    assert r["requests"] == 24 and r["failed"] == 0, r["errors"]
    assert r["output_tokens"] == 24 * 5
    assert r["arrival_s"]["n"] == 24 and r["ttft_s"]["n"] == 24  # every call reached the worker
    assert r["router_cpu_us_per_token"] > 0
