"""Where a step's GPU time goes: each kind of engine step (a full prefill chunk, a mixed step of
a prefill chunk beside running decodes, decode steps at several batch sizes) run synchronously
many times, its wall time, and its device time split by kernel kind (matmuls, FP8 activation
quantization, decode and prefill attention, norms, rotary + KV store, sampling, the rest), for
each variant (bf16, FP8 KV, FP8 weights, both; `-eager`: steps with prefill chunks run eagerly,
not from CUDA graphs), each in a process of its own.

    python benchmarks/engine/step_profile.py --model benchmarks/configs/llama-3.1-8b \\
        --variants bf16 fp8-w --out step_profile.json

A step is built from real requests: `--decode-batch` sequences with `--context`-token prompts are
prefilled and left decoding; a mixed step then adds prompts of `--prompt-len` tokens filling the
rest of the token budget (aborted again after the step), a prefill step does the same with no
decodes running. Device times come from torch.profiler over `--steps` steps of each kind (kernels
inside CUDA graphs included); wall times from the same number of unprofiled steps. `--smoke` runs
a tiny model on the CPU (no device times) so the script is tested in CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

VARIANTS = {  # name -> (--kv-cache-dtype, --quantization, steps with chunks from CUDA graphs)
    "bf16": ("auto", None, True),
    "bf16-eager": ("auto", None, False),
    "fp8-kv": ("fp8", None, True),
    "fp8-w": ("auto", "fp8", True),
    "fp8-w-eager": ("auto", "fp8", False),
    "fp8-w+kv": ("fp8", "fp8", True),
}

# Kernel name -> kind, first match wins (cuBLAS/CUTLASS names vary by version: several patterns).
KINDS = [
    ("norm+quant", r"rms_norm_quant_fp8"),  # the fused kernels (engine/quantization/fp8_fusion.py)
    ("act+quant", r"silu_and_mul_quant_fp8"),
    ("quant", r"quant_fp8"),
    ("fp8 scales", r"scale_product"),  # applied after a small FP8 GEMM (fp8.scales_after)
    ("gemm", r"gemm|gemv|nvjet|xmma|cutlass|sm90_|ampere_|wgmma|_scaled_mm|splitK|fp8_gemv"),
    ("attn_decode", r"paged_decode"),
    ("attn_prefill", r"paged_prefill|flash|fmha"),
    ("norm", r"rms_norm"),
    ("rope_kv", r"rotary|store_kv"),
    ("act", r"silu"),
    ("sample", r"argmax|softmax|topk|sort|multinomial|exponential|cumsum|scatter|gather"),
    ("copy", r"[Mm]emcpy|[Mm]emset|copy_|CatArrayBatched|index"),
]


def kind_of(name: str) -> str:
    for kind, pat in KINDS:
        if re.search(pat, name):
            return kind
    return "other"


def build_engine(a: argparse.Namespace, kv: str, quant: str | None, mixed_graphs: bool):
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(
        model=a.model, device=a.device, dtype=a.dtype, load_format="dummy",
        max_num_seqs=max(a.decode_batch + [int(m.split("+")[1]) for m in a.mixed]) + 64, max_num_batched_tokens=a.budget,
        max_model_len=a.context + a.prompt_len + 4 * a.steps + 64, enable_prefix_caching=False,
        async_scheduling=False, kv_cache_dtype=kv, quantization=quant,
        scheduling_policy=a.policy, mixed_cuda_graphs=mixed_graphs,
        num_blocks=a.num_blocks), progress=False)


class Steps:
    """Drives one engine into the shape of each step kind and runs that step."""

    def __init__(self, engine, a: argparse.Namespace) -> None:
        import random

        from tandem.engine.sampling_params import SamplingParams

        self.engine, self.a = engine, a
        self.params = SamplingParams(temperature=0, ignore_eos=True)  # max_tokens: per prompt
        self.rng = random.Random(0)
        self.vocab = engine.model_config.vocab_size
        self.n = 0

    def _prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(1, self.vocab) for _ in range(n)]

    def _add(self, tokens: int) -> str:
        self.n += 1
        rid = f"r{self.n}"
        # as many tokens as the context leaves (the engine refuses more)
        params = dataclasses.replace(self.params, max_tokens=self.engine.max_model_len - tokens)
        self.engine.add_request(rid, self._prompt(tokens), params)
        return rid

    def decodes(self, batch: int) -> None:
        """Exactly `batch` sequences decoding, their prompts prefilled."""
        e = self.engine
        for rid in list(e.requests):
            e.abort(rid)
        for _ in range(batch):
            self._add(self.a.context)
        while e.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                         for s in e.scheduler.running):
            e.step()
        e.step()

    def chunk_step(self, tokens: int) -> float:
        """One step of the running decodes and `tokens` of fresh prompts; the prompts are
        aborted afterwards (so every repetition has the same shape). Wall seconds."""
        e, a = self.engine, self.a
        room = tokens
        rids = []
        while room > 0:
            n = min(a.prompt_len, room)
            rids.append(self._add(n))
            room -= n
        t = time.perf_counter()
        e.step()
        _sync(a.device)
        t = time.perf_counter() - t
        for rid in rids:
            e.abort(rid)
        return t

    def decode_step(self) -> float:
        t = time.perf_counter()
        self.engine.step()
        _sync(self.a.device)
        return time.perf_counter() - t


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def measure(fn, a: argparse.Namespace) -> dict:
    """Median wall ms of `fn` over --steps runs, then device ms by kind over --steps more."""
    for _ in range(2):
        fn()
    wall = statistics.median(fn() for _ in range(a.steps)) * 1e3
    out = {"wall_ms": wall}
    if not a.device.startswith("cuda"):
        return out
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            fn()
    kinds: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        us = ev.self_device_time_total
        if us <= 0:
            continue
        kinds[kind_of(ev.key)] += us / 1e3 / a.steps
        top[ev.key[:90]] += us / 1e3 / a.steps
    out["device_ms"] = sum(kinds.values())
    if a.host_profile:
        out["host_top"] = host_profile(fn, a.steps)
    out["kinds_ms"] = dict(kinds)
    out["top"] = sorted(top.items(), key=lambda kv: -kv[1])[:12]
    return out


def host_profile(fn, steps: int) -> list[tuple[str, float, float]]:
    """Where the host's time goes in `fn`: the functions with the most time of their own
    (cProfile tottime, then cumtime), ms per step."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    st = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_, _, tt, ct, _) in st.stats.items():
        rows.append((f"{Path(file).name}:{line}({name})", tt * 1e3 / steps, ct * 1e3 / steps))
    return sorted(rows, key=lambda r: -r[1])[:25]


def run_variant(a: argparse.Namespace, kv: str, quant: str | None, mixed_graphs: bool) -> dict:
    engine = build_engine(a, kv, quant, mixed_graphs)
    s = Steps(engine, a)
    rows = []
    for spec in a.mixed:
        p, d = (int(x) for x in spec.split("+"))
        s.decodes(d)
        kind = f"mixed {p}+{d}" if d else f"prefill {p}"
        rows.append({"step": kind, **measure(lambda p=p: s.chunk_step(p), a)})
    for b in a.decode_batch:
        s.decodes(b)
        rows.append({"step": f"decode {b}", **measure(s.decode_step, a)})
    for rid in list(engine.requests):
        engine.abort(rid)
    card = "cpu"
    if a.device.startswith("cuda"):
        import torch

        card = torch.cuda.get_device_name()
    return {"card": card, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="benchmarks/configs/llama-3.1-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variants", nargs="+", default=["bf16"], choices=list(VARIANTS))
    ap.add_argument("--budget", type=int, default=2048, help="tokens per step (engine flag)")
    ap.add_argument("--policy", default="fcfs", help="--scheduling-policy (engine flag)")
    ap.add_argument("--prompt-len", type=int, default=220, help="new prompts' length")
    ap.add_argument("--context", type=int, default=300, help="decoding sequences' prompt")
    ap.add_argument("--decode-batch", type=int, nargs="+", default=[1, 64, 256, 512])
    ap.add_argument("--mixed", nargs="+", default=["2048+0", "1792+256", "64+192"],
                    help="steps of P prompt tokens beside D decodes, as P+D (D=0: a prefill step)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--host-profile", action="store_true",
                    help="also cProfile the host side of each step kind (top functions)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU (CI)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child's variant
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.smoke:
        from tandem.engine.demo import demo_model_dir

        a.model, a.device, a.dtype = str(demo_model_dir()), "cpu", "float32"
        a.budget, a.prompt_len, a.context, a.steps = 64, 20, 16, 2
        a.decode_batch, a.mixed, a.num_blocks = [1, 4], ["64+0", "20+4"], 256
    if a.one:
        res = run_variant(a, *VARIANTS[a.one])
        a.out.write_text(json.dumps(res))
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.variants:
            out = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, __file__, *sys.argv[1:], "--one", name, "--out", str(out)]
            print(f"=== {name}", flush=True)
            if subprocess.run(cmd).returncode != 0:
                sys.exit(f"variant {name} failed")
            results[name] = json.loads(out.read_text())
    report(a, results)
    if a.out:
        a.out.write_text(json.dumps(results, indent=2))


def report(a: argparse.Namespace, results: dict) -> None:
    first = next(iter(results.values()))
    print(f"\n{first['card']}; {Path(a.model).name}; budget {a.budget}, prompts {a.prompt_len}, "
          f"decode context {a.context}; ms per step (device ms by kernel kind)")
    kinds = [k for k, _ in KINDS] + ["other"]
    print(f"{'variant':<12}{'step':<18}{'wall':>8}{'device':>8}"
          + "".join(f"{k:>13}" for k in kinds))
    for name, r in results.items():
        for row in r["rows"]:
            dev = row.get("device_ms")
            ks = row.get("kinds_ms", {})
            print(f"{name:<12}{row['step']:<18}{row['wall_ms']:>8.2f}"
                  f"{dev if dev is not None else float('nan'):>8.2f}"
                  + "".join(f"{ks.get(k, 0.0):>13.2f}" for k in kinds))
    for name, r in results.items():
        for row in r["rows"]:
            if row.get("top"):
                print(f"\n{name} {row['step']}: top kernels (ms per step)")
                for k, ms in row["top"]:
                    print(f"  {ms:8.3f}  {k}")
            if row.get("host_top"):
                print(f"\n{name} {row['step']}: host, top functions (own ms, cumulative ms "
                      "per step)")
                for k, tt, ct in row["host_top"]:
                    print(f"  {tt:8.3f} {ct:8.3f}  {k}")


if __name__ == "__main__":
    main()
