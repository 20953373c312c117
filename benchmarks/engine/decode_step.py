"""Time whole decode steps of the engine (schedule + inputs + forward + sampling) on a GPU, eager
and with CUDA graphs, against the bandwidth floor: a decode step must read every weight and
every sequence's KV once, so it cannot beat (weight bytes + KV bytes) / copy bandwidth, with
the copy bandwidth measured in the same run.

    python benchmarks/engine/decode_step.py --model benchmarks/configs/llama-3.1-8b --batch 1 64 --context 1024

FP8: --kv-cache-dtype fp8 (e4m3 KV pool) and --quantization fp8 (e4m3 weights: the weight-only
kernels/fp8_gemv.py up to 16 tokens a step, torch._scaled_mm above; compute capability >= 8.9). --variants runs several configurations, each in its own process
(a fresh GPU, so each pool is sized from the same free memory), and compares them: step time,
and the tokens the memory-sized pool holds (leave --num-blocks unset for that):

    python benchmarks/engine/decode_step.py --model benchmarks/configs/llama-3.1-8b \
        --batch 1 64 256 --variants bf16 fp8-kv fp8-w+kv --out decode_fp8.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.decode_batch import decode_batch, step_times
from benchmarks.lib.floors import describe_model
from benchmarks.lib.timing import copy_bandwidth
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine

VARIANTS = {  # name -> (--kv-cache-dtype, --quantization)
    "bf16": ("auto", None),
    "fp8-kv": ("fp8", None),
    "fp8-w": ("auto", "fp8"),
    "fp8-w+kv": ("fp8", "fp8"),
}


def run_batch(engine: LLMEngine, batch: int, context: int, steps: int, graphs: bool) -> dict:
    runner = engine.runner

    def full() -> None:
        assert engine.last_step.num_decodes == batch

    with decode_batch(engine, batch, context, graphs):
        times = step_times(engine, steps, full)
        gpu_ms = None
        if graphs and runner.graphs is not None:
            gpu_ms = _graph_replay_ms(runner.graphs, batch)
        busy = _kernel_share(engine, 10)
    step_ms = statistics.median(times) * 1e3
    return {"batch": batch, "graphs": graphs, "step_ms": step_ms,
            "tokens_per_s": batch / (step_ms / 1e3), "forward_gpu_ms": gpu_ms,
            "kernel_share": busy}


def _kernel_share(engine: LLMEngine, steps: int) -> float:
    """Share of wall-clock step time during which GPU kernels (and copies) ran, from the
    profiler's device timeline; 1 - this is the time the GPU waited on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
    device_us = sum(e.self_device_time_total for e in prof.key_averages())
    return device_us / wall_us


def _graph_replay_ms(graphs, batch: int) -> float:
    """GPU time of the captured step alone: replay the graph back to back."""
    bs = graphs.size_for[batch]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graphs.graphs[bs].replay()
    start.record()
    for _ in range(20):
        graphs.graphs[bs].replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="benchmarks/configs/llama-3.1-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    ap.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS),
                    help="compare configurations, one process each (overrides the two above)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.variants:
        compare_variants(a)
        return
    device = torch.device("cuda")
    bw = copy_bandwidth(device) * 1e9  # bytes/s
    engine = LLMEngine(EngineConfig(
        model=a.model, device="cuda", dtype=a.dtype, load_format="dummy",
        # Long enough that no sequence ends while the others are still being prefilled.
        num_blocks=a.num_blocks,
        max_model_len=a.context + a.steps + 64 + max(a.batch) * a.context // 2048,
        max_num_seqs=max(a.batch), enable_prefix_caching=False,
        kv_cache_dtype=a.kv_cache_dtype, quantization=a.quantization), progress=False)
    cfg = engine.model_config
    runner = engine.runner
    kv_token_bytes = (cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
                      * runner.kv_dtype.itemsize)
    weight_bytes = describe_model(runner.model, kv_token_bytes).weight_bytes  # what a step reads
    pool = {"pool_tokens": runner.num_blocks * runner.block_size,
            "pool_gib": runner.num_blocks * runner.block_bytes / 2**30,
            "kv_dtype": str(runner.kv_dtype).removeprefix("torch."),
            "quantization": a.quantization, "weight_bytes": weight_bytes}
    rows = []
    for batch in a.batch:
        floor_ms = (weight_bytes + batch * a.context * kv_token_bytes) / bw * 1e3
        for graphs in (False, True):
            r = run_batch(engine, batch, a.context, a.steps, graphs)
            r["floor_ms"] = floor_ms
            r["of_floor"] = floor_ms / r["step_ms"]
            rows.append(r)
    card = torch.cuda.get_device_name()
    print(f"{card}; {Path(a.model).name} dummy weights {a.dtype}"
          f"{', FP8 weights' if a.quantization else ''} (a step reads {weight_bytes / 1e9:.2f} GB); KV "
          f"{pool['kv_dtype']}, pool {pool['pool_tokens']} tokens ({pool['pool_gib']:.1f} GiB); "
          f"context {a.context}; copy bandwidth {bw / 1e9:.0f} GB/s")
    if runner.graphs is not None and runner.graphs.remap:
        print(f"batch sizes replayed in a larger graph (faster there): {runner.graphs.remap}")
    print(f"{'batch':>6}{'mode':>8}{'step ms':>10}{'tok/s':>10}{'floor ms':>10}{'of floor':>10}"
          f"{'graph ms':>10}{'outside kernels':>17}")
    for r in rows:
        gpu = r["forward_gpu_ms"]
        print(f"{r['batch']:>6}{'graphs' if r['graphs'] else 'eager':>8}{r['step_ms']:>10.2f}"
              f"{r['tokens_per_s']:>10.1f}{r['floor_ms']:>10.2f}{r['of_floor']:>10.0%}"
              f"{gpu if gpu else float('nan'):>10.2f}{1 - r['kernel_share']:>17.0%}")
    print("graph ms: the captured step (forward, LM head, greedy argmax) replayed back to back; "
          "outside kernels: share of step wall time with no GPU kernel or copy running")
    if a.out:
        a.out.write_text(json.dumps({"card": card, "copy_gbps": bw / 1e9, **pool, "rows": rows},
                                    indent=2))


def compare_variants(a: argparse.Namespace) -> None:
    """Each variant in a child process of this script; then one table of the graph-mode steps
    with ratios to the first variant, and the pool each one sized."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.variants:
            kv, quant = VARIANTS[name]
            out = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, __file__, "--model", a.model, "--dtype", a.dtype,
                   "--batch", *map(str, a.batch), "--context", str(a.context),
                   "--steps", str(a.steps), "--kv-cache-dtype", kv, "--out", str(out)]
            cmd += ["--quantization", quant] if quant else []
            cmd += ["--num-blocks", str(a.num_blocks)] if a.num_blocks else []
            print(f"=== {name}: {' '.join(cmd[1:])}", flush=True)
            if subprocess.run(cmd).returncode != 0:
                sys.exit(f"variant {name} failed")
            results[name] = json.loads(out.read_text())
    first = results[a.variants[0]]
    card = first["card"]
    print(f"\n{card}; {Path(a.model).name}; context {a.context}; CUDA graphs; ratios to "
          f"{a.variants[0]}")
    print(f"{'variant':<10}{'weights GB':>11}{'pool tokens':>13}{'x':>6}" + "".join(
        f"{f'b{b} ms':>10}{'x':>6}" for b in a.batch))
    for name, r in results.items():
        steps = {row["batch"]: row["step_ms"] for row in r["rows"] if row["graphs"]}
        base = {row["batch"]: row["step_ms"] for row in first["rows"] if row["graphs"]}
        line = (f"{name:<10}{r['weight_bytes'] / 1e9:>11.2f}{r['pool_tokens']:>13}"
                f"{r['pool_tokens'] / first['pool_tokens']:>6.2f}")
        line += "".join(f"{steps[b]:>10.2f}{base[b] / steps[b]:>6.2f}" for b in a.batch)
        print(line)
    print("x: speed-up (step time) or pool-size ratio against the first variant")
    if a.out:
        a.out.write_text(json.dumps({"card": card, "variants": results}, indent=2))


if __name__ == "__main__":
    main()
