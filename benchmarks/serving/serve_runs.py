"""One run of benchmarks/serving/serve.py's workload at each rate: Poisson arrival times, the load
generator (serve_client.py) sending on them, each run's summary and goodput, the CPU time and
engine steps of the stack it ran on, and the table serve.py and ratio.py print."""

from __future__ import annotations

import math
import random
import time
from typing import TYPE_CHECKING

from benchmarks.lib.common import ITL_STATS, dist, fmt, fmt_rate, itl_stat
from benchmarks.lib.procstat import (
    engine_steps,
    kv_pull_summary,
    kv_pulls,
    process_cpu_s,
    thread_deltas,
    thread_stats,
)
from benchmarks.lib.workloads import Request
from benchmarks.serving.serve_client import LoadOptions, Result, send_all

if TYPE_CHECKING:
    from tandem.cli.launcher import LocalStack


# -- one run: a workload at one rate -------------------------------------------------------------
def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals: exponential gaps of mean 1/rate seconds, the first at 0; rate inf: all
    at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def summarize(results: list[Result], opts: LoadOptions) -> dict:
    ok = [r for r in results if r.ok]
    starts = [r.sent for r in results if r.sent]
    ends = [r.sent + r.e2e for r in results if r.e2e is not None]
    duration = (max(ends) - min(starts)) if ends else float("nan")
    out_tokens = sum(r.tokens for r in ok)
    prompt_tokens = sum(r.prompt_len for r in ok)
    itls = [g for r in ok for g in r.itls]
    good = [r for r in ok
            if r.ttft * 1e3 <= opts.slo_ttft_ms
            and itl_stat(r.itls, opts.goodput_itl) * 1e3 <= opts.slo_itl_ms]
    errors = [r.error or f"{r.tokens} tokens, expected {r.expected_tokens}"
              for r in results if not r.ok]
    ms = 1e3
    return {
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": errors[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + prompt_tokens) / duration,
        "output_tokens": out_tokens,
        "expected_output_tokens": sum(r.expected_tokens for r in results),
        "ttft_ms": dist([r.ttft * ms for r in ok]),
        "tpot_ms": dist([r.tpot * ms for r in ok if r.tpot is not None]),
        "itl_ms": dist([g * ms for g in itls]),
        # the first of a request's gaps alone: where a decode worker pacing its admissions
        # (critical-path policy) holds a request after the prefill worker's first token
        "first_itl_ms": dist([r.itls[0] * ms for r in ok if r.itls]),
        "e2e_s": dist([r.e2e for r in ok]),
        "goodput": len(good) / duration,
        "slo_attainment": len(good) / len(results),
        "slo": {"ttft_ms": opts.slo_ttft_ms, "itl_ms": opts.slo_itl_ms,
                "per_request_itl": opts.goodput_itl},
    }


def good_requests(rows: list[dict], slo_ttft_ms: float, slo_itl_ms: float,
                  goodput_itl: str = "p90") -> int:
    """Requests (run_rates' per-request rows) that meet the SLOs: summarize()'s rule, again."""
    return sum(1 for r in rows if r["ok"] and r["ttft_ms"] <= slo_ttft_ms
               and r[f"itl_{goodput_itl}_ms"] <= slo_itl_ms)


def run_rates(opts: LoadOptions, requests: list[Request], rates: list[float], seed: int,
              label: str = "", warmup: list[Request] | None = None,
              cooldown_s: float = 1.0, stack: LocalStack | None = None) -> list[dict]:
    """The workload once per rate; each run: its summary, per-request rows and the samples the
    CDF plot needs. With the `stack` it runs on, the summary's cpu_s says what CPU time each
    process and the clients spent during the run, and engine_steps how many steps each worker
    ran (when the stack serves metrics)."""
    procs = stack.procs if stack is not None else {}

    def cpu() -> dict[str, float | None]:
        return {name: process_cpu_s(p.popen.pid) for name, p in procs.items()}

    def threads() -> dict[str, dict[str, dict[str, float]]]:
        return {name: thread_stats(p.popen.pid) for name, p in procs.items()}

    def steps() -> dict[str, int | None]:
        return {name: engine_steps(p.metrics_url) for name, p in procs.items()
                if p.metrics_port}

    def pulls() -> dict[str, dict | None]:
        return {name: kv_pulls(p.metrics_url) for name, p in procs.items() if p.metrics_port}

    if warmup:
        w, _ = send_all(opts, warmup, [0.0] * len(warmup), f"{label}warmup")
        bad = [r.error for r in w if r.error]
        if bad:
            raise RuntimeError(f"warmup requests failed: {bad[:3]}")
    runs = []
    for k, rate in enumerate(rates):
        if k:
            time.sleep(cooldown_s)
        offsets = arrival_offsets(len(requests), rate, seed + 1000 * k)
        before, steps_before, threads_before, pulls_before = cpu(), steps(), threads(), pulls()
        results, client_cpu_s = send_all(opts, requests, offsets, f"{label}rate {fmt_rate(rate)}")
        after, steps_after, threads_after = cpu(), steps(), threads()
        s = summarize(results, opts)
        s["rate"] = rate
        s["cpu_s"] = {"client": client_cpu_s, **{
            name: after[name] - before[name] for name in before
            if before[name] is not None and after[name] is not None}}
        s["threads"] = {name: thread_deltas(threads_before[name], threads_after[name])
                        for name in threads_after}
        s["engine_steps"] = {name: steps_after[name] - steps_before[name] for name in steps_before
                             if steps_before[name] is not None and steps_after[name] is not None}
        s["kv_pulls"] = kv_pull_summary(pulls_before, pulls())
        ok = [r for r in results if r.ok]
        runs.append({
            "summary": s,
            # per request: enough to recompute goodput under other SLOs (good_requests)
            "requests": [{"prompt_len": r.prompt_len, "output_tokens": r.tokens,
                          "expected_tokens": r.expected_tokens, "ok": r.ok,
                          "ttft_ms": _ms(r.ttft), "tpot_ms": _ms(r.tpot), "e2e_s": r.e2e,
                          **{f"itl_{k}_ms": _ms(itl_stat(r.itls, k)) for k in ITL_STATS},
                          "error": r.error}
                         for r in results],
            # for the plot only (not written to JSON)
            "_samples": {"ttft_ms": [r.ttft * 1e3 for r in ok],
                         "tpot_ms": [r.tpot * 1e3 for r in ok if r.tpot is not None],
                         "itl_ms": [g * 1e3 for r in ok for g in r.itls],
                         "e2e_s": [r.e2e for r in ok]},
        })
    return runs


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


# -- reporting -----------------------------------------------------------------------------------
def print_online(runs: list[dict], header: str) -> None:
    print(header)
    print(f"{'rate':>6}{'done':>7}{'dur s':>8}{'req/s':>8}{'out tok/s':>11}"
          f"{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}"
          f"{'goodput':>9}{'SLO':>6}")
    for run in runs:
        s = run["summary"]
        print(f"{fmt_rate(s['rate']):>6}{s['completed']:>4}/{s['num_requests']:<3}"
              f"{fmt(s['duration_s']):>7}{fmt(s['request_throughput'], '.2f'):>8}"
              f"{fmt(s['output_throughput'], '.0f'):>11}"
              f"{fmt(s['ttft_ms']['p50'], '.0f'):>10}{fmt(s['ttft_ms']['p99'], '.0f'):>9}"
              f"{fmt(s['tpot_ms']['p50']):>10}{fmt(s['tpot_ms']['p99']):>8}"
              f"{fmt(s['itl_ms']['p50']):>9}{fmt(s['itl_ms']['p99']):>8}"
              f"{fmt(s['goodput'], '.2f'):>9}{fmt(s['slo_attainment'], '.0%'):>6}")
        for e in s["errors"][:3]:
            print(f"    error: {e}")
        reqs = [r for r in run["requests"] if r["ok"]]
        if reqs:  # the longest generation: a ShareGPT-like run's critical path
            lr = max(reqs, key=lambda r: r["output_tokens"])
            print(f"    longest request ({lr['output_tokens']} tokens): first token at "
                  f"{fmt(lr['ttft_ms'] / 1e3, '.2f')} s, then {fmt(lr['tpot_ms'], '.2f')} ms "
                  f"a token; every request's gap after its first token: p50 "
                  f"{fmt(s['first_itl_ms']['p50'], '.0f')} ms, p99 "
                  f"{fmt(s['first_itl_ms']['p99'], '.0f')} ms")
    if runs:
        slo = runs[0]["summary"]["slo"]
        print(f"(ms; goodput in req/s: TTFT <= {slo['ttft_ms']:g} ms and per-request "
              f"{slo['per_request_itl']} ITL <= {slo['itl_ms']:g} ms)")


def plot_rows(label_prefix: str, runs: list[dict]) -> list[dict]:
    rows = []
    for run in runs:
        s = run["summary"]
        rows.append({"label": f"{label_prefix}rate {fmt_rate(s['rate'])}", "rate": s["rate"],
                     "goodput": s["goodput"], "request_throughput": s["request_throughput"],
                     "output_throughput": s["output_throughput"], **run["_samples"]})
    return rows
