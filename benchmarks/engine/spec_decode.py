"""Speculative decoding: what it buys at batch 1 and what it costs.

Three measurements (docs/speculative.md):

  latency    batch-1 end-to-end latency of greedy requests with and without speculation on
             prompts that quote or edit their input (benchmarks/data/spec_decode_prompts.jsonl,
             chat template applied), alternating the two on the same engine (the per-request
             opt-out `speculative=False` is the baseline); acceptance rate per draft position,
             tokens per step, speed-up.
  verify     the cost of a verify step of 1 + k tokens against a one-token decode step at
             batch 1, context --context (drafts that are never accepted, so every step scores
             k + 1 positions), e.g. for the Llama-3.1-8B config with dummy weights; and what
             the timed steps ran as: a decode CUDA graph, a mixed-step graph, or eagerly.
  throughput a fixed workload at batch 64 and 256 with and without --speculative-method (the
             back-off keeps large batches from speculating): output tokens per second; each
             configuration in a child process of its own (--method runs one in this one).
  steps      batch 1 on the prompt set with pipelined steps on (on the CPU too), each prompt
             once without speculation and once with: the decode steps by kind (pipelined,
             synchronous without drafts, verify) and the host's CPU time per step of each
             kind (the step's thread CPU time less the model runner's execute); torch on one
             thread, so the figures hold on a loaded machine.

--method draft --draft-model PATH proposes with a draft model (same tokenizer) instead of
prompt lookup, in latency and throughput; --min-acceptance sets the back-off by acceptance.

    python benchmarks/engine/spec_decode.py latency --model smollm2-135m-instruct --device cuda
    python benchmarks/engine/spec_decode.py verify --model benchmarks/configs/llama-3.1-8b \
        --load-format dummy --device cuda -k 3
    python benchmarks/engine/spec_decode.py throughput --model benchmarks/configs/llama-3.1-8b \
        --load-format dummy --device cuda --batch 64 256
    python benchmarks/engine/spec_decode.py steps --max-tokens 64
    python benchmarks/engine/spec_decode.py latency --model Qwen/Qwen2.5-7B-Instruct \
        --method draft --draft-model Qwen/Qwen2.5-0.5B-Instruct --device cuda

Each prints a table and, with --out, writes the figures with the device's name as JSON.
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

from benchmarks.lib.common import device_name
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.spec_decode.proposer import ProposeInput
from tandem.engine.tokenizer import Tokenizer

PROMPTS = Path(__file__).resolve().parents[1] / "data" / "spec_decode_prompts.jsonl"


def engine_for(a: argparse.Namespace, method: str | None = "ngram",
               async_scheduling: bool | None = None) -> LLMEngine:
    """An engine speculating with `method` (None: off); draft: --draft-model."""
    dtype = a.dtype or ("float32" if a.device == "cpu" else "bfloat16")
    if method == "draft" and not a.draft_model:
        sys.exit("--method draft needs --draft-model")
    kw = dict(model=a.model, device=a.device, dtype=dtype, load_format=a.load_format,
              speculative_method=method, num_speculative_tokens=a.k,
              max_model_len=a.max_model_len, speculative_min_acceptance=a.min_acceptance,
              draft_model=a.draft_model if method == "draft" else None,
              async_scheduling=async_scheduling)
    return LLMEngine(EngineConfig(**kw), progress=False)


def run_one(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams
            ) -> tuple[float, int, int]:
    """(seconds, output tokens, engine steps) of one request run alone."""
    steps = 0
    tokens = 0
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params)
    while engine.has_work():
        for o in engine.step():
            tokens += len(o.new_token_ids)
        steps += 1
    return time.perf_counter() - t0, tokens, steps


def latency(a: argparse.Namespace) -> dict:
    if a.method == "off":
        sys.exit("latency compares speculation with its absence: --method ngram or draft")
    engine = engine_for(a, a.method or "ngram")
    tok = Tokenizer(engine.model_dir)
    texts = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    rows = []
    spec = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    plain = SamplingParams(temperature=0, max_tokens=a.max_tokens, speculative=False)
    c = engine.spec.counters
    for i, item in enumerate(texts[:a.num_prompts]):
        prompt = tok.apply_chat_template([{"role": "user", "content": item["text"]}])
        for r in range(a.warmup):
            run_one(engine, f"w{i}-{r}", prompt, plain)
            run_one(engine, f"ws{i}-{r}", prompt, spec)
        base_s, with_s = [], []
        for r in range(a.repeats):  # alternating, so drift hits both alike
            s, n_plain, steps_plain = run_one(engine, f"p{i}-{r}", prompt, plain)
            base_s.append(s)
            drafted, accepted = c.num_draft_tokens, c.num_accepted_tokens
            s, n_spec, steps_spec = run_one(engine, f"s{i}-{r}", prompt, spec)
            with_s.append(s)
            drafted, accepted = c.num_draft_tokens - drafted, c.num_accepted_tokens - accepted
        rows.append({"kind": item["kind"], "tokens": n_spec,
                     "plain_s": statistics.median(base_s), "spec_s": statistics.median(with_s),
                     "acceptance": accepted / drafted if drafted else 0.0,
                     "tokens_per_step": n_spec / max(steps_spec, 1),
                     "plain_tokens_per_step": n_plain / max(steps_plain, 1)})
    print(f"{'prompt':<10} {'tokens':>6} {'plain ms':>9} {'spec ms':>9} {'speed-up':>8} "
          f"{'accept':>7} {'tok/step':>8}")
    for r in rows:
        print(f"{r['kind']:<10} {r['tokens']:>6} {1e3 * r['plain_s']:>9.1f} "
              f"{1e3 * r['spec_s']:>9.1f} {r['plain_s'] / r['spec_s']:>7.2f}x "
              f"{r['acceptance']:>7.2f} {r['tokens_per_step']:>8.2f}")
    total_plain = sum(r["plain_s"] for r in rows)
    total_spec = sum(r["spec_s"] for r in rows)
    per_pos = [acc / d if d else 0.0 for acc, d in zip(c.accepted_at, c.drafted_at)]
    print(f"all: {total_plain / total_spec:.2f}x faster; acceptance per draft position "
          + " ".join(f"{x:.2f}" for x in per_pos))
    # Steps with a pipelined step in flight in which a sample could have speculated: resolved
    # for drafts (synchronous) or kept pipelined (no draft expected). Warm-up runs included.
    print(f"steps in flight for a speculating sample: {c.num_resolved_steps} resolved for "
          f"drafts, {c.num_pipelined_steps} kept pipelined")
    return {"rows": rows, "speedup": total_plain / total_spec, "acceptance_per_position": per_pos,
            "resolved_steps": c.num_resolved_steps, "pipelined_steps": c.num_pipelined_steps}


def steps(a: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    engine = engine_for(a, a.method or "ngram", async_scheduling=True)
    tok = Tokenizer(engine.model_dir)
    texts = [json.loads(line) for line in PROMPTS.read_text().splitlines()][:a.num_prompts]
    execute, in_execute = engine.runner.execute, [0.0]

    def timed(*args, **kwargs):
        t = time.thread_time()
        try:
            return execute(*args, **kwargs)
        finally:
            in_execute[0] += time.thread_time() - t

    engine.runner.execute = timed
    launch, behind = engine.pipeline.launch, [False]

    def launched(batch, prev):  # pipelined: launched behind a step still in flight
        behind[0] = prev is not None
        return launch(batch, prev)

    engine.pipeline.launch = launched
    c = engine.spec.counters
    out = {}
    for name, opt_in in (("plain", False), ("spec", True)):
        host: dict[str, list[float]] = {"pipelined": [], "sync": [], "verify": []}
        tokens = 0
        for i, item in enumerate(texts):
            prompt = tok.apply_chat_template([{"role": "user", "content": item["text"]}])
            engine.add_request(f"{name}{i}", prompt, SamplingParams(
                temperature=0, max_tokens=a.max_tokens, speculative=opt_in))
            while engine.has_work():
                in_execute[0], behind[0] = 0.0, False
                t = time.thread_time()
                tokens += sum(len(o.new_token_ids) for o in engine.step())
                cpu = time.thread_time() - t - in_execute[0]
                s = engine.last_step
                if s.num_seqs and s.num_tokens <= 1 + a.k:  # decode steps (prompts aside)
                    kind = ("verify" if s.num_tokens > 1 else
                            "pipelined" if behind[0] else "sync")
                    host[kind].append(cpu)
        out[name] = {"tokens": tokens, **{kind: {"steps": len(v), "host_ms": 1e3 *
                                                 statistics.median(v) if v else 0.0}
                                          for kind, v in host.items()}}
    print(f"{'run':<6} {'tokens':>6} {'pipelined':>16} {'sync, no draft':>16} {'verify':>16}"
          "   (steps, host CPU ms/step median)")
    for name, r in out.items():
        cells = " ".join(f"{r[k]['steps']:>7} {r[k]['host_ms']:>8.3f}"
                         for k in ("pipelined", "sync", "verify"))
        print(f"{name:<6} {r['tokens']:>6} {cells}")
    print(f"accepted {c.num_accepted_tokens} of {c.num_draft_tokens} drafts")
    return {**out, "accepted": c.num_accepted_tokens, "drafted": c.num_draft_tokens}


class NeverRight:
    """k drafts that the model never samples (a token outside its vocabulary would be refused:
    these are real ids, each one the token just sampled, which a random model almost never
    repeats k times): every verify step scores k + 1 positions and keeps one token."""

    def propose(self, inp: ProposeInput) -> list[list[int]]:
        return [[s.token_ids[-1]] * k for s, k in zip(inp.seqs, inp.max_tokens)]

    def release(self, seq) -> None:
        pass


def replays(engine: LLMEngine) -> tuple[int, int]:
    """Steps replayed so far from the decode and from the mixed-step CUDA graphs."""
    runner = engine.runner
    return (runner.graphs.replays if runner.graphs is not None else 0,
            runner.mixed_graphs.replays if runner.mixed_graphs is not None else 0)


def graph_kind(before: tuple[int, int], after: tuple[int, int]) -> str:
    """What one step ran as: a decode graph, a mixed-step graph, or eagerly."""
    if after[0] > before[0]:
        return "decode"
    return "mixed" if after[1] > before[1] else "eager"


def verify(a: argparse.Namespace) -> dict:
    # Drafts that are never accepted would pause a sample after a few steps (the back-off by
    # acceptance); every step here must verify, so it is off.
    engine = engine_for(argparse.Namespace(**{**vars(a), "min_acceptance": 0.0}))
    engine.spec.proposer = NeverRight()
    vocab = engine.model_config.vocab_size
    prompt = [(7 * j) % (vocab - 1) + 1 for j in range(a.context)]
    out: dict = {}
    kinds: dict[str, dict[str, int]] = {}  # per step kind: timed steps per graph kind
    for name, opt_in in (("decode", False), ("verify", True)):
        times = []
        kinds[name] = {}
        params = SamplingParams(temperature=0, max_tokens=a.steps + 8, ignore_eos=True,
                                speculative=opt_in)
        engine.add_request(name, prompt, params)
        while engine.has_work():
            before = replays(engine)
            engine.step()
            s = engine.last_step
            if s is not None and s.num_seqs and s.num_tokens == (1 + a.k if opt_in else 1):
                times.append(engine.last_execute_s)
                if len(times) > a.warmup:
                    kind = graph_kind(before, replays(engine))
                    kinds[name][kind] = kinds[name].get(kind, 0) + 1
        out[name] = statistics.median(times[a.warmup:]) if len(times) > a.warmup else None
    ratio = out["verify"] / out["decode"]
    ran = {name: " + ".join(f"{kind} {n}" for kind, n in sorted(k.items()))
           for name, k in kinds.items()}
    print(f"batch 1, context {a.context}: one-token step {1e3 * out['decode']:.3f} ms, "
          f"verify step of 1+{a.k} {1e3 * out['verify']:.3f} ms, ratio {ratio:.3f}; "
          f"steps timed by graph kind: one-token {ran['decode']}, verify {ran['verify']}")
    return {**out, "ratio": ratio, "context": a.context, "k": a.k, "graph_kinds": kinds}


def throughput(a: argparse.Namespace) -> dict:
    """Each configuration in a process of its own: an engine's GPU memory (its pool sized to
    what is free, its CUDA graphs) is not all given back when it is dropped, so a second
    engine in the same process would find too little. --method runs one configuration here."""
    if a.method is not None:
        return {"rows": throughput_rows(a, None if a.method == "off" else a.method)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in ("off", "ngram", *(("draft",) if a.draft_model else ())):
            out = Path(tmp) / f"{method}.json"
            cmd = [sys.executable, __file__, *without_option(sys.argv[1:], "--out"),
                   "--method", method, "--out", str(out)]
            print(f"=== speculation {method}: {' '.join(cmd[1:])}", flush=True)
            if subprocess.run(cmd).returncode != 0:
                sys.exit(f"throughput with speculation {method} failed")
            rows += json.loads(out.read_text())["rows"]
    print(f"{'speculation':<12} {'batch':>6} {'tokens/s':>10}")
    for r in rows:
        print(f"{r['method']:<12} {r['batch']:>6} {r['tokens_per_s']:>10.1f}")
    return {"rows": rows}


def without_option(argv: list[str], name: str) -> list[str]:
    """argv without option `name` and its value (`name value` or `name=value`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        elif not arg.startswith(name + "="):
            out.append(arg)
    return out


def throughput_rows(a: argparse.Namespace, method: str | None) -> list[dict]:
    """Output tokens per second of the fixed workload at each --batch, in one engine."""
    engine = engine_for(a, method)
    vocab = engine.model_config.vocab_size
    rows = []
    for batch in a.batch:
        params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"{method}-{batch}-{i}",
                               [(11 * i + 3 * j) % (vocab - 1) + 1 for j in range(a.context)],
                               params)
        tokens = 0
        t0 = time.perf_counter()
        while engine.has_work():
            tokens += sum(len(o.new_token_ids) for o in engine.step())
        rows.append({"method": method or "off", "batch": batch,
                     "tokens_per_s": tokens / (time.perf_counter() - t0)})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["latency", "verify", "throughput", "steps"])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("-k", type=int, default=3, help="draft tokens per step")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--num-prompts", type=int, default=10, help="latency: prompts of the set")
    p.add_argument("--repeats", type=int, default=3, help="latency: runs of each, median")
    p.add_argument("--warmup", type=int, default=1, help="runs (steps for verify) not timed")
    p.add_argument("--context", type=int, default=1024, help="verify, throughput: prompt length")
    p.add_argument("--steps", type=int, default=50, help="verify: steps timed")
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256], help="throughput")
    p.add_argument("--method", choices=["off", "ngram", "draft"], default=None,
                   help="latency: the proposer (default ngram); throughput: this "
                        "configuration only, in this process (by default off, ngram and, "
                        "with --draft-model, draft, each in a child process of its own)")
    p.add_argument("--draft-model", default=None,
                   help="the draft checkpoint of --method draft (same tokenizer as --model)")
    p.add_argument("--min-acceptance", type=float, default=0.3,
                   help="--speculative-min-acceptance (the back-off by acceptance; 0: off)")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    a = p.parse_args(argv)
    result = {"latency": latency, "verify": verify, "throughput": throughput,
              "steps": steps}[a.what](a)
    if a.out is not None:
        a.out.write_text(json.dumps({"what": a.what, "device": device_name(a.device),
                                     "model": a.model, "k": a.k, "command": sys.argv,
                                     **result}, indent=2))


if __name__ == "__main__":
    main()
