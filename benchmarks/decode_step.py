"""Time whole decode steps of the engine (schedule + inputs + forward + sampling) on a GPU, eager
and with CUDA graphs, against the bandwidth floor: a decode step must read every weight and
every sequence's KV once, so it cannot beat (weight bytes + KV bytes) / copy bandwidth, with
the copy bandwidth measured in the same run.

    python benchmarks/decode_step.py --model benchmarks/configs/llama-3.1-8b --batch 1 64 --context 1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import copy_bandwidth
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def run_batch(engine: LLMEngine, batch: int, context: int, steps: int, graphs: bool,
              vocab: int) -> dict:
    runner = engine.runner
    saved = runner.graphs
    if not graphs:
        runner.graphs = None
    try:
        params = SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True)
        g = torch.Generator().manual_seed(batch)
        for i in range(batch):
            prompt = torch.randint(1, vocab, (context,), generator=g).tolist()
            engine.add_request(f"b{batch}-{i}-{graphs}", prompt, params)
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
                or engine.scheduler.waiting:
            engine.step()
        for _ in range(3):
            engine.step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
            assert engine.last_step.num_decodes == batch
        gpu_ms = None
        if graphs and runner.graphs is not None:
            gpu_ms = _graph_replay_ms(runner.graphs, batch)
        busy = _kernel_share(engine, 10)
    finally:
        for rid in list(engine.requests):
            engine.abort(rid)
        runner.graphs = saved
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
    bs = next(s for s in graphs.sizes if s >= batch)
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
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    device = torch.device("cuda")
    bw = copy_bandwidth(device) * 1e9  # bytes/s
    engine = LLMEngine(EngineConfig(
        model=a.model, device="cuda", dtype=a.dtype, load_format="dummy",
        # Long enough that no sequence ends while the others are still being prefilled.
        num_blocks=a.num_blocks,
        max_model_len=a.context + a.steps + 64 + max(a.batch) * a.context // 2048,
        max_num_seqs=max(a.batch), enable_prefix_caching=False), progress=False)
    cfg = engine.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    kv_token_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * torch.finfo(
        engine.runner.dtype).bits // 8
    rows = []
    for batch in a.batch:
        floor_ms = (weight_bytes + batch * a.context * kv_token_bytes) / bw * 1e3
        for graphs in (False, True):
            r = run_batch(engine, batch, a.context, a.steps, graphs, cfg.vocab_size)
            r["floor_ms"] = floor_ms
            r["of_floor"] = floor_ms / r["step_ms"]
            rows.append(r)
    card = torch.cuda.get_device_name()
    print(f"{card}; {Path(a.model).name} dummy weights {a.dtype} ({weight_bytes / 1e9:.2f} GB); "
          f"context {a.context}; copy bandwidth {bw / 1e9:.0f} GB/s")
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
        a.out.write_text(json.dumps({"card": card, "copy_gbps": bw / 1e9, "rows": rows},
                                    indent=2))


if __name__ == "__main__":
    main()
