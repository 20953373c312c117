"""A changing mix through a 1P+1D stack, with per-request placement on (cost-placement) and off
(prefix-affinity, every prompt on the prefill worker): time to first token, inter-token latency
and throughput per phase.

    # CPU, shm, tandem-demo: both placements on fresh stacks, off first
    python benchmarks/serving/changing_mix.py
    python benchmarks/serving/changing_mix.py --placement on --out mix.json

Phases, one after the other on the same stack (requests sent at a steady rate within each):
    chat        short prompts (--chat-prompt tokens), answers of --chat-output tokens
    summarize   long prompts (--long-prompt), short answers (--summary-output)
    agent       conversations whose context grows each turn (--agent-context to start,
                --agent-new tokens a turn, answers of --agent-output): every turn's prompt is
                the last one plus its answer and the new tokens
Greedy, ignore_eos. TTFT: send -> first token; ITL: the gaps between a request's later chunks;
throughput: output tokens over the phase's wall time. The outputs of both runs are compared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.lib.common import percentile  # noqa: E402

POLICY = {"off": "prefix-affinity", "on": "cost-placement"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", default="tandem-demo")
    p.add_argument("--placement", default="both", choices=["on", "off", "both"])
    p.add_argument("--chat-requests", type=int, default=24)
    p.add_argument("--chat-rate", type=float, default=6.0)
    p.add_argument("--chat-prompt", type=int, default=32)
    p.add_argument("--chat-output", type=int, default=32)
    p.add_argument("--summaries", type=int, default=8)
    p.add_argument("--summary-rate", type=float, default=2.0)
    p.add_argument("--long-prompt", type=int, default=768)
    p.add_argument("--summary-output", type=int, default=8)
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--agent-turns", type=int, default=3)
    p.add_argument("--agent-context", type=int, default=512)
    p.add_argument("--agent-new", type=int, default=32)
    p.add_argument("--agent-output", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON results")
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("router_args", nargs="*", help="after --: more router flags (placement on)")
    return p


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(1, 250) for _ in range(n)]  # below the demo vocabulary's specials


async def one(stub, prompt: list[int], max_tokens: int) -> dict:
    from tandem.v1 import api_pb2, common_pb2

    msg = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompt),
                                  params=common_pb2.SamplingParams(
                                      max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
    t0 = time.monotonic()
    ttft, last, gaps, out = None, None, [], []
    async for chunk in stub.Generate(msg, timeout=600):
        if not chunk.token_ids:
            continue
        now = time.monotonic()
        if ttft is None:
            ttft = now - t0
        else:
            gaps.append(now - last)
        last = now
        out += chunk.token_ids
    return {"ttft": ttft, "gaps": gaps, "tokens": out}


async def at_rate(jobs: list[tuple[list[int], int]], rate: float, stub) -> list[dict]:
    async def send(k: int, prompt: list[int], n: int) -> dict:
        await asyncio.sleep(k / rate)
        return await one(stub, prompt, n)

    return await asyncio.gather(*(send(k, p, n) for k, (p, n) in enumerate(jobs)))


async def agents(a: argparse.Namespace, rng: random.Random, stub) -> list[dict]:
    """Each agent's turns in order; the agents side by side."""
    async def agent(i: int) -> list[dict]:
        own = random.Random(rng.random() + i)  # its own draws, whatever order turns end in
        await asyncio.sleep(i * 0.25)
        prompt, done = tokens(own, a.agent_context), []
        for _ in range(a.agent_turns):
            r = await one(stub, prompt, a.agent_output)
            done.append(r)
            prompt = prompt + r["tokens"] + tokens(own, a.agent_new)
        return done

    return [r for rs in await asyncio.gather(*(agent(i) for i in range(a.agents))) for r in rs]


def summary(results: list[dict], seconds: float) -> dict:
    ttft = [r["ttft"] * 1e3 for r in results]
    gaps = [g * 1e3 for r in results for g in r["gaps"]]
    return {"requests": len(results), "ttft_p50": percentile(ttft, 50),
            "ttft_p90": percentile(ttft, 90), "itl_p50": percentile(gaps, 50),
            "itl_p90": percentile(gaps, 90),
            "tok_s": sum(len(r["tokens"]) for r in results) / seconds}


async def run_phases(stack, a: argparse.Namespace) -> dict:
    import grpc

    from tandem.v1 import api_pb2_grpc

    rng = random.Random(a.seed)
    phases: dict[str, dict] = {}
    outputs: dict[str, list] = {}
    async with grpc.aio.insecure_channel(stack.router.address) as ch:
        stub = api_pb2_grpc.TandemStub(ch)
        await one(stub, tokens(rng, 16), 4)  # warm-up: the workers' step times measured
        work = {
            "chat": lambda: at_rate([(tokens(rng, a.chat_prompt), a.chat_output)
                                     for _ in range(a.chat_requests)], a.chat_rate, stub),
            "summarize": lambda: at_rate([(tokens(rng, a.long_prompt), a.summary_output)
                                          for _ in range(a.summaries)], a.summary_rate, stub),
            "agent": lambda: agents(a, rng, stub)}
        for name, make in work.items():
            t0 = time.monotonic()
            results = await make()
            phases[name] = summary(results, time.monotonic() - t0)
            outputs[name] = [r["tokens"] for r in results]
            print(f"  {name}: {phases[name]}", flush=True)
    return {"phases": phases, "outputs": outputs}


def launch(a: argparse.Namespace, label: str):
    from tandem.cli.launcher import LocalStack

    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    router = ["--grpc-port", "0", "--http-port", "-1", "--max-model-len", str(a.max_model_len),
              "--routing-policy", POLICY[label], *(a.router_args if label == "on" else [])]
    stack = LocalStack(a.model, ["prefill", "decode"], ["cpu", "cpu"],
                       worker_args=["--max-model-len", str(a.max_model_len)],
                       router_args=router,
                       log_dir=a.log_dir / label if a.log_dir else None, env=env)
    return stack.start()


def print_table(runs: dict[str, dict]) -> None:
    print(f"\n{'phase':<10} {'placement':<9} {'TTFT p50':>9} {'TTFT p90':>9} {'ITL p50':>8} "
          f"{'ITL p90':>8} {'tok/s':>7}   (ms)")
    phases = next(iter(runs.values()))["phases"]
    for name in phases:
        for label, run in runs.items():
            s = run["phases"][name]
            print(f"{name:<10} {label:<9} {s['ttft_p50']:>9.1f} {s['ttft_p90']:>9.1f} "
                  f"{s['itl_p50']:>8.1f} {s['itl_p90']:>8.1f} {s['tok_s']:>7.1f}")


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    runs: dict[str, dict] = {}
    for label in (["off", "on"] if a.placement == "both" else [a.placement]):
        print(f"placement {label} ({POLICY[label]}): 1 prefill + 1 decode worker", flush=True)
        stack = launch(a, label)
        try:
            runs[label] = asyncio.run(run_phases(stack, a))
        finally:
            stack.stop()
    print_table(runs)
    if len(runs) == 2:
        same = sum(x == y for name in runs["on"]["outputs"]
                   for x, y in zip(runs["off"]["outputs"][name], runs["on"]["outputs"][name]))
        total = sum(len(v) for v in runs["on"]["outputs"].values())
        print(f"\noutputs identical with placement on and off: {same}/{total}")
    if a.out:
        a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                     "runs": {k: v["phases"] for k, v in runs.items()}},
                                    indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
