"""Offline profiler: the engine alone in this process (`LLM.generate`, every request at once) on
the serving benchmark's workload, with KV-memory and step-time figures.

    python benchmarks/serving/offline.py --model benchmarks/configs/llama-3.1-8b \\
        --load-format dummy --devices cuda:0 --workload sharegpt --num-requests 1000
    # the same as
    python benchmarks/serving/serve.py --mode offline ...

Engine flags after `--` go to the engine, e.g. `-- --max-num-seqs 256`. Takes serve.py's
workload flags; --devices names one device.

While LLM.generate runs, the engine's step observer (`LLMEngine.on_step`) records after every
step: token times per request, the sequences running and KV slots allocated vs filled (paged
waste, against what static batches of --static-batch-size would reserve for the same requests),
the step's kind and wall time (`LLMEngine.last_step`) and the model runner's share of it
(`last_execute_s`). With pipelined steps (the engine's default) a step() call launches step
N+1, then waits for step N's tokens and outputs them: the model runner's share is the launches
plus that wait. On CUDA every --gpu-time-every-th step starts a profile (torch.profiler) that
splits the time into GPU busy time (kernels and copies) and the rest (Python, scheduling,
launches, host syncs): one step's wall time for synchronous steps; with pipelined steps, whose
device work crosses step boundaries, a window of --gpu-window consecutive steps, set against its
device timeline. The profiler is slow (trace parsing): throughput and latencies come from runs
with --gpu-time-every 0; a profiled run's throughput pays for its profiler and is no figure
(its bookkeeping alone is taken off the duration). On CUDA the card's matmul and copy rates are measured first
and the run is set against its floors (benchmarks/lib/floors.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The repository first, even when PYTHONPATH already lists it: the script's own directory
# (a benchmarks/ folder) must not shadow a package of the same name.
sys.path.insert(0, str(ROOT))

from benchmarks.lib.common import (  # noqa: E402
    add_output_args,
    add_stack_args,
    add_warmup_arg,
    check_lengths,
    dist,
    environment,
    fmt,
    model_vocab,
    progress_bar,
    resolve_devices,
    split_passthrough,
    warmup_requests,
    write_report,
)
from benchmarks.lib.procstat import pin, pin_plan  # noqa: E402
from benchmarks.lib.workloads import (  # noqa: E402
    Request,
    add_workload_args,
    build_workload,
    describe,
    static_batch_kv,
)
from benchmarks.serving.step_recorder import SATURATED_SEQS, STEP_KINDS, StepRecorder  # noqa: E402


def run_offline(a: argparse.Namespace, requests: list[Request], warmup: list[Request],
                passthrough: list[str]) -> dict:
    """The workload through LLM.generate in this process; the report's measured part."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # no log lines per profiled step
    import torch

    from tandem.engine.llm import LLM
    from tandem.engine.sampling_params import SamplingParams
    from tandem.runtime.engine_args import add_engine_args, engine_config

    device = resolve_devices(a.devices, 1)[0]
    cores = pin_plan(["client", "engine"])["engine"] if a.pin else None
    if cores:
        pin(os.getpid(), cores)
    p = argparse.ArgumentParser(prog="offline.py (engine flags after --)")
    add_engine_args(p)  # the workers' defaults
    ea = p.parse_args(["--model", a.model, "--device", device, "--dtype", a.dtype,
                       "--load-format", a.load_format, "--max-model-len", str(a.max_model_len),
                       *passthrough])
    cfg = engine_config(ea)
    card = None
    if device.startswith("cuda"):
        from benchmarks.lib.floors import measure_card

        card = measure_card(device)
    t = time.perf_counter()
    llm = LLM.from_config(cfg, progress=False)
    startup_s = time.perf_counter() - t
    if warmup:
        llm.generate([r.prompt for r in warmup],
                     [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0)
                      for r in warmup])
    gpu_every = a.gpu_time_every if device.startswith("cuda") else 0
    engine = llm.engine
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0)
              for r in requests]
    bar = progress_bar(len(requests), "offline", a.progress)
    window = a.gpu_window or (16 if engine.pipeline.enabled else 1)
    rec = StepRecorder(engine, gpu_every, on_finished=bar.update, gpu_window=window)
    rec.attach()
    compiled0 = triton_variants(device)
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        outs = llm.generate([r.prompt for r in requests], params)
    finally:
        t1, c1 = time.perf_counter(), time.process_time()
        rec.detach()
        bar.close()
    duration = t1 - t0 - rec.record_s  # a profiled run pays for its profiler (see above)
    compiled = triton_variants(device)
    counts = [len(o.outputs[0].token_ids) for o in outs]
    wrong = [i for i, (c, r) in enumerate(zip(counts, requests)) if c != r.max_tokens]
    ids = [o.request_id for o in outs]
    ttft = [(rec.first[i] - t0) * 1e3 for i in ids if i in rec.first]
    e2e = [rec.done[i] - t0 for i in ids if i in rec.done]
    tpot = [(rec.done[i] - rec.first[i]) / (c - 1) * 1e3
            for i, c in zip(ids, counts) if c > 1 and i in rec.done]
    out_tokens = sum(counts)
    pool_slots = engine.block_pool.num_blocks * engine.block_pool.block_size
    static = static_batch_kv(requests, a.static_batch_size)
    kv = {
        "block_size": engine.block_pool.block_size,
        "pool_slots": pool_slots,
        "max_num_seqs": engine.config.max_num_seqs,
        "peak_running_seqs": rec.peak_running,
        "peak_used_slots": rec.peak_used_blocks * engine.block_pool.block_size,
        # allocated but unfilled: Σ_steps (blocks of running seqs × block size − tokens in
        # them) / Σ_steps allocated
        "paged_waste": (1 - rec.filled_slot_steps / rec.alloc_slot_steps
                        if rec.alloc_slot_steps else None),
        "paged_waste_mean_per_step": (sum(rec.step_waste) / len(rec.step_waste)
                                      if rec.step_waste else None),
        "preemptions": engine.scheduler.num_preemptions,
        "static": static,
        # rows that B × (P + O) reservations of this workload's average size fit in this pool
        "static_rows_fitting_pool": int(pool_slots // static["mean_reserved_slots_per_row"]),
    }
    steps = {"steps": rec.steps, "calls_without_batch": rec.calls_without_batch,
             "step_s_total": rec.step_s,
             "step_ms_mean": rec.step_s / max(1, rec.steps) * 1e3,
             "execute_share": rec.execute_s / rec.step_s if rec.step_s else None,
             "outside_execute_share": 1 - rec.execute_s / rec.step_s if rec.step_s else None,
             "profiler_overhead_s": rec.profiler_s, "probe_bookkeeping_s": rec.record_s,
             "excluded_from_duration_s": rec.record_s,
             "by_kind": rec.step_account(),
             "saturated_output_throughput": (rec.saturated[0] / rec.saturated[1]
                                             if rec.saturated[1] else None)}
    floor = None
    if card is not None:
        from benchmarks.lib.floors import describe_model, floors

        model = describe_model(engine.runner.model,
                               engine.runner.block_bytes // engine.block_pool.block_size)
        floor = floors(card, model, [len(r.prompt) for r in requests], counts,
                       [rec.first[i] - t0 for i in ids], duration)
    return {
        "mode": "offline", "device": device,
        "card": torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda")
        else "cpu",
        "engine_config": {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name != "extra"},
        "num_blocks": engine.block_pool.num_blocks,
        "startup_s": startup_s,
        # Triton kernel variants compiled at start-up and during the measured run (each a
        # stall of the step that needed it; start-up should leave none for the run)
        "triton_variants": {"startup": compiled0, "during_run": (
            compiled - compiled0 if compiled is not None and compiled0 is not None else None)},
        "num_requests": len(requests), "completed": len(requests) - len(wrong),
        "wrong_length": wrong[:10],
        "duration_s": duration, "output_tokens": out_tokens,
        "cpu_s": {"engine": c1 - c0},  # this process, all threads, recorder included
        "pinned": {"engine": cores} if a.pin else None,
        "expected_output_tokens": sum(r.max_tokens for r in requests),
        "request_throughput": len(requests) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(len(r.prompt) for r in requests)) / duration,
        "ttft_ms": dist(ttft), "tpot_ms": dist(tpot),
        "itl_ms": dist([g * 1e3 for g in rec.itls]), "e2e_s": dist(e2e),
        "kv": kv, "step_time": steps, "floors": floor,
        "longest_request": longest_request(counts, [rec.first.get(i) for i in ids],
                                           [rec.done.get(i) for i in ids], t0),
        "_samples": {"ttft_ms": ttft, "tpot_ms": tpot,
                     "itl_ms": [g * 1e3 for g in rec.itls], "e2e_s": e2e},
    }


def longest_request(counts: list[int], first: list, done: list, t0: float) -> dict:
    """The request with the most output tokens (a ShareGPT-like run's critical path): when its
    first token came, and its decode's pace after it."""
    i = max(range(len(counts)), key=counts.__getitem__)
    out = {"index": i, "output_tokens": counts[i], "ttft_s": None, "tpot_ms": None}
    if first[i] is not None:
        out["ttft_s"] = first[i] - t0
        if done[i] is not None and counts[i] > 1:
            out["tpot_ms"] = (done[i] - first[i]) / (counts[i] - 1) * 1e3
    return out


def triton_variants(device: str) -> int | None:
    """Triton kernel variants this process has compiled (or loaded), on CUDA."""
    if not device.startswith("cuda"):
        return None
    from tandem.kernels import compiled_variants

    return sum(compiled_variants().values())


def print_offline(r: dict, header: str) -> None:
    print(header)
    print(f"{r['completed']}/{r['num_requests']} requests in {r['duration_s']:.2f} s: "
          f"{r['request_throughput']:.2f} req/s, {r['output_throughput']:.0f} output tok/s, "
          f"{r['total_token_throughput']:.0f} total tok/s; TTFT p50 {fmt(r['ttft_ms']['p50'], '.0f')}"
          f" ms, TPOT p50 {fmt(r['tpot_ms']['p50'])} ms; saturated phase (>= {SATURATED_SEQS} "
          f"running) {fmt(r['step_time']['saturated_output_throughput'], '.0f')} output tok/s")
    lr = r.get("longest_request")
    if lr and lr["ttft_s"] is not None:
        print(f"longest request (#{lr['index']}, {lr['output_tokens']} tokens): first token at "
              f"{lr['ttft_s']:.2f} s, then {fmt(lr['tpot_ms'], '.2f')} ms a token")
    tv = r.get("triton_variants") or {}
    if tv.get("startup") is not None:
        print(f"start-up {r['startup_s']:.1f} s; Triton kernel variants compiled by then "
              f"{tv['startup']}, during the run {tv['during_run']}")
    f = r.get("floors")
    if f:
        c = f["card"]
        print(f"floors (card: {c['matmul_tflops']:.0f} TFLOP/s bf16 matmul, {c['copy_gbps']:.0f} "
              f"GB/s copy, measured): compute {f['compute_floor_s']:.2f} s ({f['tflop']:.0f} "
              f"TFLOP), bandwidth {f['bandwidth_floor_s']:.2f} s, critical path "
              f"{f['critical_path_s']:.2f} s (request {f['critical_request']['index']}: first "
              f"token at {f['critical_request']['earliest_first_token_s']:.2f} s at the earliest,"
              f" {f['critical_request']['measured_first_token_s']:.2f} s measured; "
              f"{f['critical_request']['output_tokens']} tokens at "
              f"{f['batch1_step_floor_ms']:.2f} ms); bound by {f['bound_by']}: this run is "
              f"{f['share_of_floor']:.0%} of its floor")
        if f.get("compute_sustained_s"):
            print(f"    its FLOPs at the matmul rate the card holds back to back "
                  f"({c['matmul_sustained_tflops']:.0f} TFLOP/s, at its power limit): "
                  f"{f['compute_sustained_s']:.2f} s, {f['compute_sustained_s'] / r['duration_s']:.0%}"
                  f" of this run")
    kv, st = r["kv"], r["kv"]["static"]
    print(f"KV: peak {kv['peak_running_seqs']} sequences running (max_num_seqs "
          f"{kv['max_num_seqs']}); slots allocated but unfilled {fmt(kv['paged_waste'], '.1%')} "
          f"(paged, {kv['block_size']}-token blocks) vs {st['reserved_waste']:.1%} reserved by "
          f"static batches of {st['batch_size']} (B x (max prompt + max new)); "
          f"{st['dynamic_cache_waste']:.1%} with a growing cache")
    print(f"    pool {kv['pool_slots']} slots: fits {kv['static_rows_fitting_pool']} static rows "
          f"of this workload's mean reservation; peak slots in use {kv['peak_used_slots']}; "
          f"{kv['preemptions']} preemptions")
    s = r["step_time"]
    print(f"steps: {s['steps']}, mean {s['step_ms_mean']:.2f} ms; outside the model runner "
          f"(scheduling, bookkeeping) {fmt(s['outside_execute_share'], '.1%')}")
    k = s["by_kind"]
    if k["gpu_error"]:
        print(f"    GPU time: unavailable ({k['gpu_error']})")
    print(f"    {'step kind':>9}{'steps':>7}{'tokens':>9}{'wall ms':>9}{'GPU busy':>10}"
          f"{'host ms':>9}{'host %':>8}  (GPU figures: windows of {k['gpu_window']} steps "
          f"every {k['gpu_sampled_every']}; a kind's row from windows of that kind alone)")
    for name in (*STEP_KINDS, "all"):
        row = k[name]
        print(f"    {name:>9}{row['steps']:>7}{row['tokens']:>9}{fmt(row['wall_ms_mean'], '.2f'):>9}"
              f"{fmt(row['gpu_busy_ms_mean'], '.2f'):>10}{fmt(row['host_ms_mean'], '.2f'):>9}"
              f"{fmt(row['host_share'], '.1%'):>8}")


def add_offline_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("offline")
    g.add_argument("--gpu-time-every", type=int, default=10,
                   help="profile every Nth engine step's GPU busy time (0: off; CUDA only)")
    g.add_argument("--gpu-window", type=int, default=0,
                   help="consecutive steps each profile covers (0: 16 with pipelined steps, "
                        "whose device work spans step boundaries, else 1)")
    g.add_argument("--static-batch-size", type=int, default=64,
                   help="the static batch size the KV comparison assumes")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Engine flags after `--` go to the engine.")
    add_stack_args(p)
    add_workload_args(p)
    add_warmup_arg(p.add_argument_group("load"))
    add_offline_args(p)
    add_output_args(p)
    p.add_argument("--pin", action="store_true",
                   help="this process on one physical core (Linux): the one the first worker "
                        "of serve.py --pin would get")
    return p


def measure(a: argparse.Namespace, passthrough: list[str], command: str,
            benchmark: str = "offline") -> int:
    """The whole run from parsed flags: print, write --out and --plot; 1 if any request came
    out with the wrong length."""
    if not a.model:
        raise SystemExit("offline: --model is required")
    vocab, model_max = model_vocab(a.model)
    requests = build_workload(a, vocab)
    check_lengths(requests, min(a.max_model_len, model_max))
    report = {"benchmark": benchmark, "label": a.label, "mode": "offline", "model": a.model,
              "dtype": a.dtype, "load_format": a.load_format, "workload": a.workload,
              "workload_stats": describe(requests), "seed": a.seed,
              "engine_args": passthrough, "environment": environment(), "command": command}
    title = f"{a.label or Path(a.model).name} offline {a.workload} x{a.num_requests}"
    r = run_offline(a, requests, warmup_requests(a, vocab), passthrough)
    report.update(r)
    print_offline(r, f"== {title} on {r['card']} ({a.dtype})")
    write_report(report, a, [{"label": "offline", "rate": None, **r["_samples"]}], title)
    return 1 if report["wrong_length"] else 0


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else list(argv)
    args, passthrough = split_passthrough(raw)
    a = build_parser().parse_args(args)
    return measure(a, passthrough, " ".join(["benchmarks/serving/offline.py", *raw]))


if __name__ == "__main__":
    sys.exit(main())
