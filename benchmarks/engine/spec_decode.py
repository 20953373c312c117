"""Speculative decoding: what it buys at batch 1 and what it costs.

Five measurements (docs/speculative.md):

  latency    batch-1 end-to-end latency of greedy requests with and without speculation on
             prompts that quote or edit their input (benchmarks/data/spec_decode_prompts.jsonl,
             chat template applied), alternating the two on the same engine (the per-request
             opt-out `speculative=False` is the baseline); acceptance rate per draft position,
             tokens per step, speed-up.
  verify     the cost of a verify step of 1 + k tokens against a one-token decode step at
             batch 1, context --context (drafts that are never accepted, so every step scores
             k + 1 positions), e.g. for the Llama-3.1-8B config with dummy weights; and what
             the timed steps ran as: a decode CUDA graph, a mixed-step graph, or eagerly.
  throughput a fixed workload at batch 64 and 256 (greedy, --context prompt tokens,
             --max-tokens outputs, all requests added at once) with and without speculation,
             both in one engine in this process (the runs without it detach its speculator:
             the same pool, CUDA graphs and memory), --repeats runs of each alternating after
             --warmup untimed ones: output tokens per second (medians, their ratio, each
             pair's), and what speculation did in its runs: steps resolved for drafts, verifies,
             drafts accepted, the proposer's host time (total, and the largest in one step).
             On the CPU with a small model (benchmarks/configs/llama-3.1-8b-tiny: the 8B's
             vocabulary, two narrow layers) it measures the host's side: the median host CPU
             time a step with and without speculation (torch on one thread).
  steps      batch 1 on the prompt set with pipelined steps on (on the CPU too), each prompt
             once without speculation and once with: the decode steps by kind (pipelined,
             synchronous without drafts, verify) and the host's CPU time per step of each
             kind (the step's thread CPU time less the model runner's execute); torch on one
             thread, so the figures hold on a loaded machine.
  gaps       batch 1 on the prompt set with speculation, --repeats runs: the device's idle
             gaps (from the host's return from waiting for the last step launched to the next
             launch: before a verify, after it, before a request's first step) and the
             host's time in them by engine phase.

--method draft --draft-model PATH proposes with a draft model (same tokenizer) instead of
prompt lookup, in latency and throughput; --min-acceptance sets the back-off by acceptance.

    python benchmarks/engine/spec_decode.py latency --model smollm2-135m-instruct --device cuda
    python benchmarks/engine/spec_decode.py verify --model benchmarks/configs/llama-3.1-8b \
        --load-format dummy --device cuda -k 3
    python benchmarks/engine/spec_decode.py throughput --model benchmarks/configs/llama-3.1-8b \
        --load-format dummy --device cuda --batch 64 256
    python benchmarks/engine/spec_decode.py throughput --model benchmarks/configs/llama-3.1-8b-tiny \
        --load-format dummy --batch 64 256
    python benchmarks/engine/spec_decode.py steps --max-tokens 64
    python benchmarks/engine/spec_decode.py gaps --model smollm2-135m-instruct --device cuda -k 8
    python benchmarks/engine/spec_decode.py latency --model Qwen/Qwen2.5-7B-Instruct \
        --method draft --draft-model Qwen/Qwen2.5-0.5B-Instruct --device cuda

Each prints a table and, with --out, writes the figures with the device's name as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
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
               async_scheduling: bool | None = None, **config) -> LLMEngine:
    """An engine speculating with `method` (None: off); draft: --draft-model; `config`: more
    EngineConfig fields."""
    dtype = a.dtype or ("float32" if a.device == "cpu" else "bfloat16")
    if method == "draft" and not a.draft_model:
        sys.exit("--method draft needs --draft-model")
    kw = dict(model=a.model, device=a.device, dtype=dtype, load_format=a.load_format,
              speculative_method=method, num_speculative_tokens=a.k,
              max_model_len=a.max_model_len, speculative_min_acceptance=a.min_acceptance,
              draft_model=a.draft_model if method == "draft" else None,
              async_scheduling=async_scheduling, **config)
    return LLMEngine(EngineConfig(**kw), progress=False)


def run_one(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams,
            kinds: dict[str, list[float]] | None = None) -> tuple[float, int, int]:
    """(seconds, output tokens, engine steps) of one request run alone; with `kinds`, each
    decode step's wall seconds appended under its kind (step_kinds)."""
    steps = 0
    tokens = 0
    behind = step_kinds(engine) if kinds is not None else None
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params)
    while engine.has_work():
        if behind is not None:
            behind[0] = False
        t = time.perf_counter()
        for o in engine.step():
            tokens += len(o.new_token_ids)
        if behind is not None and steps:  # the prompt's step aside
            s = engine.last_step
            if s.num_seqs:
                kind = "verify" if s.num_tokens > 1 else "pipelined" if behind[0] else "sync"
                kinds.setdefault(kind, []).append(time.perf_counter() - t)
        steps += 1
    return time.perf_counter() - t0, tokens, steps


def step_kinds(engine: LLMEngine) -> list[bool]:
    """Marks the steps launched behind a step still in flight: the returned flag is set by
    such a launch (the caller clears it before each step). Installed once per engine."""
    flag = getattr(engine, "_bench_behind", None)
    if flag is None:
        flag = engine._bench_behind = [False]
        launch = engine.pipeline.launch

        def launched(batch, prev):
            flag[0] = prev is not None
            return launch(batch, prev)

        engine.pipeline.launch = launched
    return flag


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
    kinds: dict[str, dict[str, list[float]]] = {"plain": {}, "spec": {}}
    for i, item in enumerate(texts[:a.num_prompts]):
        prompt = tok.apply_chat_template([{"role": "user", "content": item["text"]}])
        for r in range(a.warmup):
            run_one(engine, f"w{i}-{r}", prompt, plain)
            run_one(engine, f"ws{i}-{r}", prompt, spec)
        base_s, with_s = [], []
        for r in range(a.repeats):  # alternating, so drift hits both alike
            s, n_plain, steps_plain = run_one(engine, f"p{i}-{r}", prompt, plain,
                                              kinds["plain"])
            base_s.append(s)
            drafted, accepted = c.num_draft_tokens, c.num_accepted_tokens
            s, n_spec, steps_spec = run_one(engine, f"s{i}-{r}", prompt, spec, kinds["spec"])
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
    if a.profile:  # the speculating runs once more under cProfile: where a step's host time goes
        import cProfile
        import pstats

        prof = cProfile.Profile()
        for i, item in enumerate(texts[:a.num_prompts]):
            prompt = tok.apply_chat_template([{"role": "user", "content": item["text"]}])
            prof.enable()
            run_one(engine, f"prof{i}", prompt, spec)
            prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    # Decode steps by kind, every timed run (the prompt's step aside): pipelined (launched
    # behind a step in flight), sync (launched with none in flight: after a verify, or
    # resolved for a draft that did not come), verify; wall ms each and in all.
    account = {run: {kind: {"steps": len(v), "ms_median": 1e3 * statistics.median(v),
                            "ms_total": 1e3 * sum(v)} for kind, v in by.items()}
               for run, by in kinds.items()}
    for run, by in account.items():
        print(f"{run} decode steps: " + "; ".join(
            f"{kind} {v['steps']} x {v['ms_median']:.3f} ms (total {v['ms_total']:.1f})"
            for kind, v in sorted(by.items())))
    return {"rows": rows, "speedup": total_plain / total_spec, "acceptance_per_position": per_pos,
            "resolved_steps": c.num_resolved_steps, "pipelined_steps": c.num_pipelined_steps,
            "steps_by_kind": account}


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
    behind = step_kinds(engine)  # set by a launch behind a step still in flight
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


class GapClock:
    """The device's idle gaps at batch 1, as the host sees them: each span from the host's
    return from waiting for the last step launched (a pipelined step's tokens, a synchronous
    step's sampling) to its next launch (a CUDA graph's replay; on the CPU, the model runner's
    forward pass), and the host's time in it by engine phase (the innermost of the methods
    below that is running; "other": none of them). Installs wrappers on the engine's objects
    (for good: the engine serves this measurement only) and on three classes, which `close`
    takes off."""

    PHASES = (("engine", "step"), ("engine", "_run"), ("engine", "_verified"),
              ("pipeline", "launch"), ("pipeline", "_apply_tokens"), ("spec", "begin_step"),
              ("spec", "expects_draft"), ("spec", "propose"), ("scheduler", "schedule"),
              ("scheduler", "advance"), ("scheduler", "remove_finished"),
              ("runner", "step_inputs"), ("block_tables", "gather"), ("graphs", "run_step"),
              ("sampler", "sample"))

    def __init__(self, engine: LLMEngine) -> None:
        from tandem.engine import sampler, step_tokens

        self.gaps: list[float] = []
        self.by_phase: dict[str, float] = {}
        self._stack: list[str] = []
        self._launches = 0
        self._since: float | None = None  # the last wait's end, while in a gap
        self._mark = 0.0
        runner = engine.runner
        owners = {"engine": engine, "pipeline": engine.pipeline, "spec": engine.spec,
                  "scheduler": engine.scheduler, "runner": runner,
                  "block_tables": runner.block_tables, "graphs": runner.graphs,
                  "sampler": runner.sampler}
        for owner, name in self.PHASES:
            if owners[owner] is not None:
                self._wrap(owners[owner], name, f"{owner}.{name}")
        clock = self
        pending, samp = step_tokens.PendingTokens, sampler.Sampler
        self._restore = [(pending, "__init__", pending.__init__),
                         (pending, "tolist", pending.tolist), (samp, "__call__", samp.__call__)]
        init, tolist, call = pending.__init__, pending.tolist, samp.__call__

        def made(self_, *args, **kwargs):
            init(self_, *args, **kwargs)
            self_._bench_launch = clock._launches

        def waited(self_):
            out = tolist(self_)
            if self_._bench_launch == clock._launches:  # nothing queued behind it
                clock._waited()
            return out

        def sampled(self_, *args, **kwargs):
            out = call(self_, *args, **kwargs)
            clock._waited()
            return out

        pending.__init__, pending.tolist, samp.__call__ = made, waited, sampled
        if runner.graphs is not None:
            replay = torch.cuda.CUDAGraph.replay
            self._restore.append((torch.cuda.CUDAGraph, "replay", replay))

            def replayed(self_):
                clock._launched()
                return replay(self_)

            torch.cuda.CUDAGraph.replay = replayed
        else:
            forward = runner.forward

            def forwarded(*args, **kwargs):
                clock._launched()
                return forward(*args, **kwargs)

            runner.forward = forwarded

    def _wrap(self, owner, name: str, label: str) -> None:
        fn = getattr(owner, name)
        clock = self

        def timed(*args, **kwargs):
            clock._switch()
            clock._stack.append(label)
            try:
                return fn(*args, **kwargs)
            finally:
                clock._switch()
                clock._stack.pop()

        setattr(owner, name, timed)

    def _switch(self) -> None:
        """The time since the last mark, to the running phase, inside a gap."""
        now = time.perf_counter()
        if self._since is not None:
            phase = self._stack[-1] if self._stack else "other"
            self.by_phase[phase] = self.by_phase.get(phase, 0.0) + now - self._mark
        self._mark = now

    def _waited(self) -> None:
        self._switch()
        self._since = self._mark

    def _launched(self) -> None:
        self._launches += 1
        if self._since is not None:
            self._switch()
            self.gaps.append(self._mark - self._since)
            self._since = None

    def close(self) -> None:
        for cls, name, fn in self._restore:
            setattr(cls, name, fn)


def gaps(a: argparse.Namespace) -> dict:
    """The speculating runs of the prompt set (--repeats each, after --warmup), their device
    idle gaps and the host's time in them by phase (GapClock)."""
    if a.method == "off":
        sys.exit("gaps measures speculation: --method ngram or draft")
    engine = engine_for(a, a.method or "ngram")
    tok = Tokenizer(engine.model_dir)
    texts = [json.loads(line) for line in PROMPTS.read_text().splitlines()][:a.num_prompts]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t["text"]}]) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    for r in range(a.warmup):
        for i, p in enumerate(prompts):
            run_one(engine, f"w{r}-{i}", p, params)
    clock = GapClock(engine)
    try:
        for r in range(a.repeats):
            for i, p in enumerate(prompts):
                run_one(engine, f"g{r}-{i}", p, params)
    finally:
        clock.close()
    g = clock.gaps
    total = sum(g)
    print(f"{len(g)} device idle gaps in {a.repeats} runs of {len(prompts)} prompts: "
          f"{1e3 * total:.1f} ms, median {1e6 * statistics.median(g):.0f} us")
    print(f"{'phase (host time inside the gaps)':<36} {'ms':>8} {'us/gap':>8} {'share':>6}")
    for phase, s in sorted(clock.by_phase.items(), key=lambda kv: -kv[1]):
        print(f"{phase:<36} {1e3 * s:>8.2f} {1e6 * s / len(g):>8.1f} {s / total:>6.1%}")
    return {"gaps": len(g), "gap_ms_total": 1e3 * total, "gap_us_median":
            1e6 * statistics.median(g), "phase_ms": {k: 1e3 * v for k, v in
                                                      clock.by_phase.items()}}


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


class SpecProbe:
    """What a run with speculation did: its counters' growth and the time its proposer took
    per step (prompt lookup's index and lookups; a draft model's passes too): wall time on a
    GPU, the thread's CPU time on the CPU (which holds on a loaded machine)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.spec = engine.spec
        self.clock = time.thread_time if engine.runner.device.type == "cpu" else time.perf_counter
        self.step_s: list[float] = []  # per engine step: seconds in the proposer
        proposer = self.spec.proposer
        for name in ("propose", "expects_draft"):
            call = getattr(proposer, name, None)
            if call is not None:
                setattr(proposer, name, self._timed(call))
        c = self.spec.counters
        self._start = (c.num_resolved_steps, c.num_verifies, c.num_draft_tokens,
                       c.num_accepted_tokens)

    def _timed(self, call):
        def timed(*args):
            t = self.clock()
            try:
                return call(*args)
            finally:
                self.step_s[-1] += self.clock() - t
        return timed

    def begin_step(self) -> None:
        self.step_s.append(0.0)

    def summary(self) -> dict:
        c = self.spec.counters
        now = (c.num_resolved_steps, c.num_verifies, c.num_draft_tokens, c.num_accepted_tokens)
        resolved, verifies, drafted, accepted = (b - a for a, b in zip(self._start, now))
        return {"resolved_steps": resolved, "verifies": verifies, "drafted": drafted,
                "accepted": accepted, "proposer_ms": 1e3 * sum(self.step_s),
                "proposer_max_step_ms": 1e3 * max(self.step_s, default=0.0)}


class GcCollections:
    """The garbage collector's collections while it is open, per generation, and the time the
    whole-heap ones took: a step's host work that allocates many tracked objects brings them
    on, and a whole-heap collection holds the step's thread for tens of milliseconds."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.full_s = 0.0
        self._t = 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
            return
        self.counts[info["generation"]] += 1
        if info["generation"] == 2:
            self.full_s += time.perf_counter() - self._t

    def close(self) -> None:
        gc.callbacks.remove(self._on)

    def summary(self) -> dict:
        return {"gc_collections": self.counts, "gc_full_ms": 1e3 * self.full_s}


def fixed_run(engine: LLMEngine, a: argparse.Namespace, batch: int, run: int, on: bool
              ) -> dict:
    """The fixed workload once: `batch` greedy requests of --context prompt tokens and
    --max-tokens outputs, all added at once; with speculation or with the engine's speculator
    detached (the same engine, pool and CUDA graphs, stepping exactly as an engine built
    without speculation). Every run's prompts start with a token of its own, so no run hits
    the prefix cache of an earlier one."""
    vocab = engine.model_config.vocab_size
    spec = engine.spec
    assert spec is not None and not engine.has_work()
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    for i in range(batch):
        body = [(11 * i + 3 * j) % (vocab - 1) + 1 for j in range(1, a.context)]
        engine.add_request(f"run{run}-{i}", [1 + run % (vocab - 1), *body], params)
    probe = SpecProbe(engine) if on else None
    execute, in_execute = engine.runner.execute, [0.0]

    def timed(*args, **kwargs):
        t = time.thread_time()
        try:
            return execute(*args, **kwargs)
        finally:
            in_execute[0] += time.thread_time() - t

    engine.runner.execute = timed
    if not on:
        engine.spec = None
    tokens, host = 0, []
    collections = GcCollections()
    try:
        t0 = time.perf_counter()
        while engine.has_work():
            if probe is not None:
                probe.begin_step()
            in_execute[0] = 0.0
            t = time.thread_time()
            tokens += sum(len(o.new_token_ids) for o in engine.step())
            host.append(time.thread_time() - t - in_execute[0])
        seconds = time.perf_counter() - t0
    finally:
        collections.close()
        engine.spec = spec
        del engine.runner.execute
        if probe is not None:
            for name in ("propose", "expects_draft"):
                spec.proposer.__dict__.pop(name, None)
    host.sort()
    return {"method": a.method if on else "off", "batch": batch, "tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / seconds, "steps": len(host),
            # the step's thread CPU time less the runner's execute: meaningful on the CPU
            # (on a GPU it counts the waits for the device as well)
            "host_ms_p50": 1e3 * host[len(host) // 2], "host_ms_max": 1e3 * host[-1],
            "host_ms_total": 1e3 * sum(host), **collections.summary(),
            **(probe.summary() if probe is not None else {})}


def throughput_engine(a: argparse.Namespace) -> LLMEngine:
    """The engine both configurations run in: pipelined steps on the CPU too, as on a GPU; no
    host KV tier (later runs would copy to it the blocks that earlier runs left in the prefix
    cache, as the pool fills)."""
    if a.method == "off":
        sys.exit("throughput compares speculation with its absence: --method ngram or draft")
    a.method = a.method or "ngram"
    return engine_for(a, a.method, async_scheduling=True, host_kv_cache_gb=0)


def throughput(a: argparse.Namespace, engine: LLMEngine | None = None) -> dict:
    """The fixed workload at each --batch, without speculation and with --method, both in ONE
    engine in this process: after --warmup untimed runs of each, --repeats timed runs of each,
    alternating; medians and their ratio per batch size."""
    if a.device == "cpu":
        torch.set_num_threads(1)  # host figures that hold on a loaded machine
    engine = engine or throughput_engine(a)
    method = a.method
    runs, n = [], 0
    for batch in a.batch:
        for r in range(a.warmup + a.repeats):
            for on in (False, True) if r % 2 == 0 else (True, False):
                row = fixed_run(engine, a, batch, n, on)
                n += 1
                if r >= a.warmup:
                    runs.append(row)
                    print(json.dumps(row), flush=True)
    table = []
    for batch in a.batch:
        off = [r for r in runs if r["batch"] == batch and r["method"] == "off"]
        on = [r for r in runs if r["batch"] == batch and r["method"] == method]
        med = {name: statistics.median(r["tokens_per_s"] for r in rows)
               for name, rows in (("off", off), (method, on))}
        table.append({"batch": batch, "off": med["off"], method: med[method],
                      "ratio": med[method] / med["off"],
                      "ratios": [b["tokens_per_s"] / o["tokens_per_s"] for o, b in zip(off, on)],
                      **{k: statistics.median_low(r[k] for r in on) for k in (
                          "resolved_steps", "verifies", "drafted", "accepted", "proposer_ms",
                          "proposer_max_step_ms")},
                      **{k: [statistics.median(r[k] for r in rows) for rows in (off, on)]
                         for k in ("host_ms_p50", "host_ms_max", "host_ms_total")},
                      # whole-heap collections over all the runs of each configuration
                      "full_gcs": [sum(r["gc_collections"][2] for r in rows)
                                   for rows in (off, on)]})
    print(f"{device_name(a.device)}, {a.model}, context {a.context}, {a.max_tokens} tokens a "
          f"request, medians of {a.repeats} runs each")
    print(f"{'batch':>5} {'off tok/s':>10} {method + ' tok/s':>11} {'x':>6} {'runs x':>17} "
          f"{'resolved':>8} {'verifies':>8} {'accepted':>9} {'proposer ms':>14} "
          f"{'full GCs off/' + method:>16}")
    for t in table:
        print(f"{t['batch']:>5} {t['off']:>10.1f} {t[method]:>11.1f} {t['ratio']:>6.3f} "
              f"{' '.join(f'{x:.3f}' for x in t['ratios']):>17} {t['resolved_steps']:>8} "
              f"{t['verifies']:>8} {t['accepted']:>4}/{t['drafted']:<4} "
              f"{t['proposer_ms']:>7.1f} ({t['proposer_max_step_ms']:.2f}) "
              f"{t['full_gcs'][0]:>7}/{t['full_gcs'][1]:<3}")
    if a.device == "cpu":  # thread CPU time: it holds on a loaded machine, wall time does not
        print(f"host CPU ms, off -> {method}: {'batch':>5} {'a step (median)':>17} "
              f"{'largest step':>15} {'the run':>17}")
        for t in table:
            cells = [f"{t[k][0]:.3f} -> {t[k][1]:.3f}" for k in ("host_ms_p50", "host_ms_max")]
            print(f"{'':<{len(method) + 17}} {t['batch']:>5} {cells[0]:>17} {cells[1]:>15} "
                  f"{t['host_ms_total'][0]:>7.1f} -> {t['host_ms_total'][1]:.1f}")
    return {"rows": table, "runs": runs}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["latency", "verify", "throughput", "steps", "gaps"])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("-k", type=int, default=3, help="draft tokens per step")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--num-prompts", type=int, default=10, help="latency: prompts of the set")
    p.add_argument("--repeats", type=int, default=3,
                   help="latency, throughput: runs of each, median")
    p.add_argument("--warmup", type=int, default=1, help="runs (steps for verify) not timed")
    p.add_argument("--context", type=int, default=1024, help="verify, throughput: prompt length")
    p.add_argument("--steps", type=int, default=50, help="verify: steps timed")
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256], help="throughput")
    p.add_argument("--method", choices=["off", "ngram", "draft"], default=None,
                   help="latency, throughput, steps: the proposer (default ngram)")
    p.add_argument("--draft-model", default=None,
                   help="the draft checkpoint of --method draft (same tokenizer as --model)")
    p.add_argument("--min-acceptance", type=float, default=0.3,
                   help="--speculative-min-acceptance (the back-off by acceptance; 0: off)")
    p.add_argument("--profile", action="store_true",
                   help="latency: the speculating runs once more under cProfile (top 30 printed)")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    result = {"latency": latency, "verify": verify, "throughput": throughput,
              "steps": steps, "gaps": gaps}[a.what](a)
    if a.out is not None:
        a.out.write_text(json.dumps({"what": a.what, "device": device_name(a.device),
                                     "model": a.model, "k": a.k, "command": sys.argv,
                                     **result}, indent=2))


if __name__ == "__main__":
    main()
