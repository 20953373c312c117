"""Tensor parallelism on GPUs: TP 2 against TP 1 of one model (dummy weights), each size in a
process of its own (a fresh GPU, so pools are sized from the same free memory).

    # greedy parity on a fixed prompt set: float32 token for token, and bf16's agreement rate
    python benchmarks/engine/tensor_parallel.py parity --model benchmarks/configs/llama-3.1-8b
    # decode step latency at batch 1 and 64, and the share of the step in NCCL collectives
    python benchmarks/engine/tensor_parallel.py step --model benchmarks/configs/llama-3.1-8b --batch 1 64
    # the KV pool each rank sizes (a model one card cannot serve: TP 1 reports why)
    python benchmarks/engine/tensor_parallel.py pool --model benchmarks/configs/qwen2.5-32b

Serving throughput goes through benchmarks/serving/serve.py with the flag after `--`
(benchmarks/gpu_tp.sh runs everything). `--device cpu` runs the same on the CPU (gloo), for a
smoke test with a tiny checkpoint.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

NUM_PROMPTS = 16
NEW_TOKENS = 64


def prompts(vocab: int) -> list[list[int]]:
    """A fixed prompt set: 16 prompts of 16 .. 496 random token ids (seeded)."""
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(1, vocab, (16 + 32 * i,), generator=g).tolist()
            for i in range(NUM_PROMPTS)]


# -- one size, in its own process ---------------------------------------------------------------
def child(a: argparse.Namespace) -> None:
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    torch.set_num_threads(1 if a.device != "cpu" else torch.get_num_threads())
    out: dict = {"tp": a.tp, "dtype": a.dtype}
    try:
        engine = LLMEngine(EngineConfig(
            model=a.model, device=a.device, dtype=a.dtype, load_format=a.load_format,
            tensor_parallel_size=a.tp, max_model_len=a.max_model_len, max_num_seqs=a.max_seqs,
            enable_prefix_caching=False, cuda_graphs=not a.no_cuda_graphs), progress=False)
    except Exception as e:  # noqa: BLE001 - reported: a model one card cannot serve
        out["error"] = f"{type(e).__name__}: {e}"
        a.out.write_text(json.dumps(out))
        return
    try:
        runner = engine.runner
        out.update(card=torch.cuda.get_device_name() if a.device != "cpu" else "cpu",
                   pool_blocks=runner.num_blocks, block_size=runner.block_size,
                   pool_gib_per_rank=runner.num_blocks * runner.block_bytes / 2**30,
                   weight_gb_per_rank=sum(p.numel() * p.element_size()
                                          for p in runner.model.parameters()) / 1e9)
        if a.part == "parity":
            out["tokens"] = generate(engine, prompts(engine.model_config.vocab_size))
        elif a.part == "step":
            out["rows"] = [decode_steps(engine, b, a.context, a.steps, graphs)
                           for b in a.batch for graphs in (False, True)
                           if not graphs or runner.graphs is not None]
    finally:
        engine.shutdown()
    a.out.write_text(json.dumps(out))


def generate(engine, prompt_set: list[list[int]]) -> list[list[int]]:
    from tandem.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompt_set):
        engine.add_request(f"p{i}", p, params)
    tokens: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompt_set))}
    while engine.has_work():
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)
    return [tokens[f"p{i}"] for i in range(len(prompt_set))]


def decode_steps(engine, batch: int, context: int, steps: int, graphs: bool) -> dict:
    """Median wall time of a decode step of `batch` sequences at `context` tokens, and the
    share of it rank 0's GPU spent in NCCL kernels (all-reduce, all-gather; waiting for the
    other rank included)."""
    from benchmarks.lib.decode_batch import decode_batch, step_times

    with decode_batch(engine, batch, context, graphs):
        times = step_times(engine, steps)
        share = collective_share(engine, 10) if engine.runner.device.type == "cuda" else None
    step_ms = statistics.median(times) * 1e3
    return {"batch": batch, "graphs": graphs, "step_ms": step_ms,
            "tokens_per_s": batch / (step_ms / 1e3), "collective_share": share}


def collective_share(engine, steps: int) -> float | None:
    """NCCL kernel time on rank 0's GPU over wall-clock step time, from the profiler's device
    timeline (None when the profiler saw no kernel at all, e.g. inside graphs on old CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
    events = prof.key_averages()
    if not any(e.self_device_time_total for e in events):
        return None
    nccl_us = sum(e.self_device_time_total for e in events if "nccl" in e.key.lower())
    return nccl_us / wall_us


# -- the parent: one child per size, then a table -------------------------------------------------
def run_children(a: argparse.Namespace, runs: list[tuple[int, str]]) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for tp, dtype in runs:
            out = Path(tmp) / f"tp{tp}-{dtype}.json"
            cmd = [sys.executable, __file__, "_child", "--part", a.part, "--tp", str(tp),
                   "--dtype", dtype, "--out", str(out), "--model", a.model, "--device",
                   a.device, "--load-format", a.load_format, "--max-model-len",
                   str(a.max_model_len), "--max-seqs", str(a.max_seqs), "--context",
                   str(a.context), "--steps", str(a.steps), "--batch", *map(str, a.batch)]
            cmd += ["--no-cuda-graphs"] if a.no_cuda_graphs else []
            print(f"=== TP {tp} {dtype}", flush=True)
            rc = subprocess.run(cmd).returncode
            if rc != 0 or not out.exists():
                results.append({"tp": tp, "dtype": dtype, "error": f"exit code {rc}"})
            else:
                results.append(json.loads(out.read_text()))
    return results


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[int, float, float]:
    """Prompts equal token for token; share of tokens before each prompt's first difference;
    share of positions equal."""
    same = sum(r == g for r, g in zip(ref, got))
    prefix = 0
    for r, g in zip(ref, got):
        n = next((i for i, (x, y) in enumerate(zip(r, g)) if x != y), min(len(r), len(g)))
        prefix += n
    total = sum(len(r) for r in ref)
    equal = sum(x == y for r, g in zip(ref, got) for x, y in zip(r, g))
    return same, prefix / total, equal / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["parity", "step", "pool", "_child"])
    ap.add_argument("--model", default="benchmarks/configs/llama-3.1-8b")
    ap.add_argument("--device", default="cuda", help="cuda (ranks on cuda:0, cuda:1) or cpu")
    ap.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    ap.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtype", default="bfloat16", help="step and pool; parity runs both")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="JSON results")
    ap.add_argument("--part", dest="child_part", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.part == "_child":
        a.part = a.child_part
        child(a)
        return
    a.max_seqs = max(a.max_seqs, *a.batch)
    if a.part == "step":
        a.max_model_len = max(a.max_model_len, a.context + a.steps + 64)
    sizes = a.tp_sizes
    if a.part == "parity":
        results = run_children(a, [(tp, d) for d in ("float32", "bfloat16") for tp in sizes])
    else:
        results = run_children(a, [(tp, a.dtype) for tp in sizes])
    card = next((r["card"] for r in results if "card" in r), "?")
    print(f"\n{card}; {Path(a.model).name}, {a.load_format} weights; TP sizes {sizes}")
    for r in results:
        if "error" in r:
            print(f"TP {r['tp']} {r['dtype']}: {r['error']}")
        else:
            print(f"TP {r['tp']} {r['dtype']}: weights {r['weight_gb_per_rank']:.1f} GB per rank, "
                  f"KV pool {r['pool_blocks']} blocks = {r['pool_blocks'] * r['block_size']} "
                  f"tokens, {r['pool_gib_per_rank']:.2f} GiB per rank")
    if a.part == "parity":
        print(f"{'dtype':<10}{'TP':>4}{'prompts equal':>15}{'tokens before 1st diff':>24}"
              f"{'positions equal':>17}")
        for dtype in ("float32", "bfloat16"):
            ref = next((r for r in results if r["dtype"] == dtype and r["tp"] == sizes[0]), {})
            for r in results:
                if r["dtype"] != dtype or r["tp"] == sizes[0] or "tokens" not in r \
                        or "tokens" not in ref:
                    continue
                same, prefix, equal = agreement(ref["tokens"], r["tokens"])
                frac = f"{same}/{len(ref['tokens'])}"
                print(f"{dtype:<10}{r['tp']:>4}{frac:>15}"
                      f"{prefix:>24.1%}{equal:>17.1%}")
        print(f"({NUM_PROMPTS} prompts of 16..496 tokens, {NEW_TOKENS} greedy tokens each, "
              f"against TP {sizes[0]} of the same dtype)")
    if a.part == "step":
        print(f"{'batch':>6}{'mode':>8}" + "".join(f"{f'TP{tp} ms':>10}" for tp in sizes)
              + f"{'speedup':>9}" + "".join(f"{f'TP{tp} coll.':>11}" for tp in sizes[1:]))
        rows = {r["tp"]: {(x["batch"], x["graphs"]): x for x in r.get("rows", [])}
                for r in results}
        for key in rows.get(sizes[0], {}):
            base = rows[sizes[0]][key]
            line = f"{key[0]:>6}{'graphs' if key[1] else 'eager':>8}"
            line += "".join(f"{rows.get(tp, {}).get(key, {}).get('step_ms', float('nan')):>10.2f}"
                            for tp in sizes)
            last = rows.get(sizes[-1], {}).get(key, {}).get("step_ms", float("nan"))
            line += f"{base['step_ms'] / last:>9.2f}"
            for tp in sizes[1:]:
                share = rows.get(tp, {}).get(key, {}).get("collective_share")
                line += f"{share:>11.0%}" if share is not None else f"{'n/a':>11}"
            print(line)
        print(f"(context {a.context}; step: schedule + inputs + forward + sampling, median of "
              f"{a.steps}; coll.: share of the step rank 0's GPU spent in NCCL kernels)")
    if a.out:
        a.out.write_text(json.dumps({"model": a.model, "card": card, "results": results},
                                    indent=2))


if __name__ == "__main__":
    main()
