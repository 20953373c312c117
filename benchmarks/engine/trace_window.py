"""One window of an offline run's steps under torch.profiler: how busy the device is, where its
time goes by kernel, and what the host launches outside the CUDA graphs (with the Python line
that launched it).

    python benchmarks/engine/trace_window.py --model benchmarks/configs/llama-3.1-8b \\
        --workload sharegpt --num-requests 1000 --start 600 --steps 30 \\
        -- --scheduling-policy critical-path
    python benchmarks/engine/trace_window.py --smoke        # CPU, a tiny model (no kernels)

The workload goes through LLM.generate at once, as `serve.py --mode offline` sends it (greedy,
ignore_eos, every output as long as the workload says); the profiler starts after step
--start's output and stops after --steps more, so the window sees steady steps, not the
start-up. Device busy time is the union of kernel and copy intervals over the window's span
(first kernel to last). The Python tracer (with_stack) slows the host several-fold: steps whose
host work the device normally hides (large decode batches) show gaps here that an unprofiled
run does not have; read the busy share only for steps whose device time exceeds their host
time, and the per-kernel times always. The trace is written gzipped to --out.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.common import model_vocab, split_passthrough
from benchmarks.lib.workloads import add_workload_args, build_workload

GAP_US = 20  # gaps between kernels longer than this are listed


def busy_and_gaps(kernels: list[dict]) -> tuple[float, float, list[float]]:
    """(span us, busy us, idle gaps us) of intervals sorted by start."""
    t0, end, busy, gaps = kernels[0]["ts"], kernels[0]["ts"], 0.0, []
    for e in kernels:
        s, f = e["ts"], e["ts"] + e["dur"]
        if s > end:
            gaps.append(s - end)
        busy += max(0.0, f - max(s, end))
        end = max(end, f)
    return end - t0, busy, gaps


def launch_sites(events: list[dict], kernels: list[dict]) -> collections.Counter:
    """(kernel, innermost non-torch Python frame of its launch) -> [count, us], for device work
    launched outside graph replays."""
    launches = {e["args"].get("correlation"): e for e in events
                if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"}
    frames = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "python_function"
                     and ".py(" in e["name"] and "torch/" not in e["name"]),
                    key=lambda e: e["ts"])
    starts = [e["ts"] for e in frames]
    sites: collections.Counter = collections.Counter()
    us: collections.Counter = collections.Counter()
    for k in kernels:
        call = launches.get(k.get("args", {}).get("correlation"))
        if call is None or "Graph" in call["name"]:
            continue
        site, i = "?", bisect.bisect_right(starts, call["ts"]) - 1
        # innermost: the latest-starting frame that still encloses the launch
        while i >= 0:
            f = frames[i]
            if f["ts"] + f["dur"] >= call["ts"]:
                site = f["name"]
                break
            i -= 1
        key = (k["name"][:60], site[:90])
        sites[key] += 1
        us[key] += k["dur"]
    return collections.Counter({key: (n, us[key]) for key, n in sites.items()})


def main(argv: list[str] | None = None) -> int:
    own, engine_flags = split_passthrough(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="benchmarks/configs/llama-3.1-8b")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--start", type=int, default=600, help="steps run before the window")
    p.add_argument("--steps", type=int, default=30, help="steps in the window")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU")
    p.add_argument("--out", type=Path, default=Path("trace_window"))
    add_workload_args(p)
    a = p.parse_args(own)
    if a.smoke:
        a.model, a.device, a.dtype, a.num_requests, a.start, a.steps = (
            "tandem-demo", "cpu", "float32", 8, 3, 3)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from tandem.engine.llm import LLM
    from tandem.engine.sampling_params import SamplingParams
    from tandem.runtime.engine_args import add_engine_args, engine_config

    ep = argparse.ArgumentParser(prog="trace_window.py (engine flags after --)")
    add_engine_args(ep)
    cfg = engine_config(ep.parse_args(
        ["--model", a.model, "--device", a.device, "--dtype", a.dtype, "--load-format",
         a.load_format, "--max-model-len", str(a.max_model_len), *engine_flags]))
    llm = LLM.from_config(cfg, progress=False)
    requests = build_workload(a, model_vocab(a.model)[0])
    engine = llm.engine
    cuda = a.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    state: dict = {"n": 0, "steps": []}

    def on_step(_outs) -> None:
        s = engine.last_step
        state["n"] += 1
        if state["n"] == a.start:
            state["prof"] = profile(activities=activities, with_stack=True)
            state["prof"].__enter__()
            state["t0"] = time.perf_counter()
        elif "prof" in state and "wall" not in state:
            state["steps"].append((s.num_tokens, s.num_decodes, s.num_seqs))
            if len(state["steps"]) == a.steps:
                if cuda:
                    torch.cuda.synchronize()
                state["wall"] = time.perf_counter() - state["t0"]
                state["prof"].__exit__(None, None, None)

    engine.on_step = on_step
    llm.generate([r.prompt for r in requests],
                 [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0)
                  for r in requests])
    if "wall" not in state:
        raise SystemExit(f"the run took {state['n']} steps: fewer than --start + --steps")
    a.out.mkdir(parents=True, exist_ok=True)
    trace = a.out / f"trace_{a.workload}_{a.start}.json"
    state["prof"].export_chrome_trace(str(trace))
    with trace.open("rb") as f, gzip.open(f"{trace}.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    events = json.loads(trace.read_text())["traceEvents"]
    trace.unlink()
    steps = state["steps"]
    print(f"window: steps {a.start + 1}-{a.start + a.steps}, host wall {state['wall'] * 1e3:.1f} ms; "
          f"tokens, decodes, sequences of its first steps: {steps[:4]}")
    kernels = sorted((e for e in events if e.get("ph") == "X"
                      and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    if not kernels:
        print("no device activity recorded (CPU run)")
        return 0
    span, busy, gaps = busy_and_gaps(kernels)
    long = [g for g in gaps if g > GAP_US]
    print(f"device span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms ({busy / span:.1%}); "
          f"gaps over {GAP_US} us: {len(long)}, {sum(long) / 1e3:.2f} ms "
          f"(largest {[round(g) for g in sorted(long, reverse=True)[:8]]})")
    by: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by[e["name"][:90]][0] += 1
        by[e["name"][:90]][1] += e["dur"]
    print(f"kernels, ms a step (of {a.steps}) and launches:")
    for name, (n, us) in sorted(by.items(), key=lambda kv: -kv[1][1])[:20]:
        print(f"  {us / 1e3 / a.steps:7.3f}  {n:6d}  {name}")
    print("device work launched outside graph replays (launches, us in the window, kernel, site):")
    for (name, site), (n, us) in launch_sites(events, kernels).most_common(12):
        print(f"  {n:5d} {us:8.0f}  {name}  @ {site}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
