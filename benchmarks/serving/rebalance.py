"""Rebalance off and on: a burst of long generations placed on one decode worker whose KV pool
cannot hold them, then a second decode worker joins (scale-out). Off, the burst stays where it
was placed: the full worker preempts and recomputes while the new one idles. On (--rebalance),
the router moves running requests to the new worker by live migration.

    # CPU, shm, tandem-demo: off then on, each on a fresh 1P+2D stack
    python benchmarks/serving/rebalance.py
    python benchmarks/serving/rebalance.py --repeat 3 --out r.json   # medians of 3 pairs

Per run: the router knows prefill0 and decode0 (--workers-file); --requests requests are sent
at once (greedy, ignore_eos, --prompt random tokens, --output tokens each); once decode0 has
admitted them all, decode1 is added to the file. Measured: preemptions on the decode workers
(tandem:num_preemptions), TPOT per request ((end - first token) / (tokens - 1)), ITL (the gaps
between a request's chunks), output tokens per second over the burst's wall time, and the
router's tandem:rebalance_moves{outcome}. The outputs of both runs are compared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.lib.common import percentile  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", default="tandem-demo")
    p.add_argument("--rebalance", default="both", choices=["on", "off", "both"])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--output", type=int, default=384)
    p.add_argument("--num-blocks", type=int, default=64, help="each decode worker's KV pool")
    p.add_argument("--free-fraction", type=float, default=0.1,
                   help="--rebalance-free-fraction for the router")
    p.add_argument("--max-moves", type=int, default=1, help="--rebalance-max-moves")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each (off, on, off, on, ...): the table shows each figure's "
                        "median over them (a shared machine's noise)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON results")
    p.add_argument("--log-dir", type=Path, default=None)
    return p


def _sum_metric(text: str, name: str, label: str = "") -> float:
    """The sum of a Prometheus series' samples (those whose labels contain `label`)."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        if label in (m.group(1) or ""):
            total += float(m.group(2))
    return total


async def one(stub, prompt: list[int], max_tokens: int) -> dict:
    from tandem.v1 import api_pb2, common_pb2

    msg = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompt),
                                  params=common_pb2.SamplingParams(
                                      max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
    t0 = time.monotonic()
    first, last, gaps, out = None, None, [], []
    async for chunk in stub.Generate(msg, timeout=900):
        if not chunk.token_ids:
            continue
        now = time.monotonic()
        if first is None:
            first = now
        else:
            gaps.append(now - last)
        last = now
        out += chunk.token_ids
    tpot = (last - first) / (len(out) - 1) if len(out) > 1 else None
    return {"ttft": first - t0, "tpot": tpot, "gaps": gaps, "tokens": out}


def write_members(path: Path, lines: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{line}\n" for line in lines))
    os.replace(tmp, path)


async def burst(a: argparse.Namespace, stack, procs: dict, members: Path) -> dict:
    import grpc
    import httpx

    from tandem.v1 import api_pb2_grpc, worker_pb2, worker_pb2_grpc

    rng = random.Random(a.seed)
    prompts = [[rng.randint(1, 250) for _ in range(a.prompt)] for _ in range(a.requests)]
    p0, d0, d1, router = procs["prefill0"], procs["decode0"], procs["decode1"], procs["router"]

    async def load(p) -> worker_pb2.Load:
        async with grpc.aio.insecure_channel(p.address) as ch:
            return await worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest())

    async with grpc.aio.insecure_channel(router.address) as ch, httpx.AsyncClient() as h:
        stub = api_pb2_grpc.TandemStub(ch)
        await one(stub, prompts[0][:8], 4)  # warm-up, on decode0
        admitted = (await load(d0)).num_requests
        t0 = time.monotonic()
        runs = [asyncio.create_task(one(stub, p, a.output)) for p in prompts]
        while (await load(d0)).num_requests < admitted + a.requests:
            await asyncio.sleep(0.02)
        write_members(members, [f"prefill {p0.address}", f"decode {d0.address}",
                                f"decode {d1.address}"])
        results = await asyncio.gather(*runs)
        seconds = time.monotonic() - t0
        router_metrics = (await h.get(router.metrics_url)).text
        preemptions = 0.0
        for d in (d0, d1):
            preemptions += _sum_metric((await h.get(d.metrics_url)).text,
                                       "tandem:num_preemptions_total")
        l1 = await load(d1)
    tpot = [r["tpot"] * 1e3 for r in results if r["tpot"] is not None]
    gaps = [g * 1e3 for r in results for g in r["gaps"]]
    moves = {o: _sum_metric(router_metrics, "tandem:rebalance_moves_total", f'"{o}"')
             for o in ("moved", "not_lent", "failed", "ended")}
    return {"seconds": seconds, "preemptions": preemptions,
            "tpot_p50": percentile(tpot, 50), "tpot_p90": percentile(tpot, 90),
            "itl_p50": percentile(gaps, 50), "itl_p90": percentile(gaps, 90),
            "tok_s": sum(len(r["tokens"]) for r in results) / seconds,
            "moves": moves, "decode1_requests": l1.num_requests,
            "decode1_migrations_in": l1.migrations_in,
            "outputs": [r["tokens"] for r in results]}


def run_one(a: argparse.Namespace, label: str) -> dict:
    from tandem.cli.launcher import LocalStack, free_port

    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    stack = LocalStack(a.model, [], [], log_dir=a.log_dir / label if a.log_dir else None,
                       env=env)
    try:
        procs = {}
        for name, role in (("prefill0", "prefill"), ("decode0", "decode"),
                           ("decode1", "decode")):
            blocks = ["--num-blocks", str(a.num_blocks)] if role == "decode" else []
            procs[name] = stack.spawn(name, ["worker", "--role", role, "--device", "cpu",
                                             "--model", a.model, "--port", "0",
                                             "--cpu-threads", "1", *blocks],
                                      metrics_port=free_port())
        stack.wait_ready(list(procs.values()))
        members = stack.log_dir / "workers"
        write_members(members, [f"prefill {procs['prefill0'].address}",
                                f"decode {procs['decode0'].address}"])
        flags = (["--rebalance", "--rebalance-free-fraction", str(a.free_fraction),
                  "--rebalance-max-moves", str(a.max_moves)] if label == "on" else [])
        procs["router"] = stack.spawn("router", [
            "router", "--model", a.model, "--workers-file", str(members),
            "--membership-interval", "0.1", "--poll-interval", "0.2", "--grpc-port", "0",
            "--http-port", "0", *flags])
        stack.wait_ready([procs["router"]])
        return asyncio.run(burst(a, stack, procs, members))
    finally:
        stack.stop()


FIGURES = ("seconds", "preemptions", "tpot_p50", "tpot_p90", "itl_p50", "itl_p90", "tok_s")


def median_run(runs: list[dict]) -> dict:
    """Each figure's median over repeated runs (moves summed per outcome, then the median)."""
    out = {k: percentile([r[k] for r in runs], 50) for k in FIGURES}
    out["moves"] = {o: percentile([r["moves"][o] for r in runs], 50) for o in runs[0]["moves"]}
    out["outputs"] = runs[0]["outputs"]
    out["all_outputs"] = [r["outputs"] for r in runs]
    return out


def print_table(runs: dict[str, dict]) -> None:
    print(f"\n{'rebalance':<10} {'preempt':>8} {'TPOT p50':>9} {'TPOT p90':>9} {'ITL p50':>8} "
          f"{'ITL p90':>8} {'tok/s':>7} {'moved':>6}   (ms)")
    for label, r in runs.items():
        print(f"{label:<10} {r['preemptions']:>8.0f} {r['tpot_p50']:>9.1f} {r['tpot_p90']:>9.1f} "
              f"{r['itl_p50']:>8.1f} {r['itl_p90']:>8.1f} {r['tok_s']:>7.1f} "
              f"{r['moves']['moved']:>6.0f}")


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    every: dict[str, list[dict]] = {}
    labels = ["off", "on"] if a.rebalance == "both" else [a.rebalance]
    for i in range(a.repeat):
        for label in labels:
            print(f"rebalance {label} ({i + 1}/{a.repeat}): 1 prefill + 2 decode workers "
                  f"({a.num_blocks} blocks each), {a.requests} x {a.output} tokens", flush=True)
            r = run_one(a, label)
            every.setdefault(label, []).append(r)
            print({k: v for k, v in r.items() if k != "outputs"}, flush=True)
    runs = {label: median_run(rs) for label, rs in every.items()}
    print_table(runs)
    outputs = [o for r in runs.values() for o in r["all_outputs"]]
    same = sum(o == outputs[0] for o in outputs)
    print(f"\nruns whose outputs equal the first run's: {same}/{len(outputs)}")
    if a.out:
        a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                     "median": {k: {x: y for x, y in v.items()
                                                    if x not in ("outputs", "all_outputs")}
                                                for k, v in runs.items()},
                                     "runs": {k: [{x: y for x, y in r.items() if x != "outputs"}
                                                  for r in rs] for k, rs in every.items()}},
                                    indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
