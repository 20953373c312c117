"""Multi-turn conversations through a disaggregated stack: how much KV moves from prefill to
decode, and how many prompt tokens prefill computes, per turn, with decode-side prefix reuse on
and off, or with the host KV tier on and off.

    # CPU, shm (the default): 40 conversations x 6 turns, 2 prefill + 2 decode workers
    python benchmarks/serving/multiturn.py --num-conversations 40 --reuse both
    # GPUs, CUDA IPC: one worker per GPU
    python benchmarks/serving/multiturn.py --device cuda --transport cuda_ipc \\
        --model benchmarks/configs/llama-3.2-1b --dtype bfloat16 --load-format dummy \\
        --num-conversations 200 --first-tokens 1024 --new-tokens 128 --output-tokens 128
    # the host KV tier: pools capped so the conversations hold 4x what they do, tier off then on
    python benchmarks/serving/multiturn.py --num-conversations 40 --host-tier both \\
        --oversubscribe 4
    # the router's map of cached blocks: bytes per block hash, for 1M hashes
    python benchmarks/serving/multiturn.py --index-memory

Conversation c, turn t: the prompt is everything so far (turn 1's prompt, every earlier answer
and user message) plus `--new-tokens` random tokens; the answer is `--output-tokens` tokens
(greedy, ignore_eos). Turns go in waves: every conversation's turn t, sent at a steady
`--rate` requests per second in an order of its own (shuffled with --seed: conversations do not
take turns in a fixed order, and a fixed one would hand a round-robin router each conversation
to the same worker every turn), then the next turn once all have answered. Per turn, from the
workers' counters (GetLoad) over the wave: KV bytes and blocks the decode workers pulled,
prompt tokens the prefill workers computed; from the client: TTFT (send -> first token).

`--reuse off` starts the decode workers with --no-prefix-caching: every turn pulls its whole
prompt, as before decode-side reuse (the prefill workers' own prefix cache stays on in both).
`--reuse both` runs off, then on, on fresh stacks, and also reports whether the outputs agree.
`--routing-policy` picks the router's (default: its own, prefix-affinity); `least-loaded`, blind
to what workers cache, is the baseline that shows what routing on caches buys.

`--host-tier off|on|both` compares the host KV tier instead (docs/host-kv-tier.md; reuse on in
both): off starts every worker with --host-kv-cache-gb 0, on with `--host-kv-cache-gb` (each
worker's tier; default 1.25x its share of the conversations' KV at their last turn).
`--oversubscribe R` caps every worker's pool (--num-blocks) so that the conversations' KV at
their last turn is R times the pools of each role: the pools evict conversations between their
turns, and without the tier a later turn computes (and pulls) its evicted prefix again. Per
turn it adds the blocks the workers copied back from their tiers; after the run, every pool's
idle check and each tier's peak bytes (sampled from GetLoad through the run) against its flag.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.lib.common import counters, percentile  # noqa: E402
from tandem.kvtransfer import transports  # noqa: E402
from tandem.router_svc.routing import POLICIES  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", default="tandem-demo")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: worker i on cuda:i (mod the GPUs there are)")
    p.add_argument("--transport", default=None, choices=transports.names(),
                   help=f"default: {transports.default_for('cpu')} on the CPU, "
                        f"{transports.default_for('cuda')} on GPUs")
    p.add_argument("--num-prefill", type=int, default=2)
    p.add_argument("--num-decode", type=int, default=2)
    p.add_argument("--num-conversations", type=int, default=40)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--first-tokens", type=int, default=256, help="turn 1's prompt")
    p.add_argument("--new-tokens", type=int, default=64, help="each later turn's user message")
    p.add_argument("--output-tokens", type=int, default=32, help="each answer")
    p.add_argument("--rate", type=float, default=8.0, help="requests per second in a wave")
    p.add_argument("--reuse", default=None, choices=["on", "off", "both"],
                   help="decode-side prefix reuse (default: both; on with --host-tier)")
    p.add_argument("--host-tier", default=None, choices=["on", "off", "both"],
                   help="compare the host KV tier off and on instead of reuse")
    p.add_argument("--host-kv-cache-gb", type=float, default=None,
                   help="each worker's host tier, GiB, with --host-tier on (default: 1.25x "
                        "its share of the conversations' KV at their last turn)")
    p.add_argument("--oversubscribe", type=float, default=None, metavar="R",
                   help="cap each worker's pool (--num-blocks) so that the conversations' KV "
                        "at their last turn is R times the pools of each role")
    p.add_argument("--routing-policy", default=None, choices=sorted(POLICIES),
                   help="the router's --routing-policy (default: the router's default)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON results")
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--index-memory", action="store_true",
                   help="only measure the router's KV map: bytes per cached block hash")
    p.add_argument("worker_args", nargs="*", help="after --: flags for every worker")
    return p


# -- the workload ----------------------------------------------------------------------------
def conversations(a: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    """Per conversation, per turn, the tokens the user adds (turn 1: the whole first prompt)."""
    rng = random.Random(a.seed)
    # Byte-level and demo vocabularies start with specials at the top: stay below them.
    hi = min(vocab, 256) - 1
    return [[[rng.randint(1, hi) for _ in range(a.first_tokens if t == 0 else a.new_tokens)]
             for t in range(a.turns)] for _ in range(a.num_conversations)]


async def one(stub, prompt: list[int], max_tokens: int) -> dict:
    from tandem.v1 import api_pb2, common_pb2

    msg = api_pb2.GenerateRequest(
        token_ids=api_pb2.TokenIds(ids=prompt),
        params=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                         temperature=0.0))
    t0 = time.monotonic()
    ttft, tokens, cached = None, [], 0
    async for chunk in stub.Generate(msg, timeout=600):
        if chunk.token_ids and ttft is None:
            ttft = time.monotonic() - t0
        tokens += chunk.token_ids
        cached = chunk.usage.cached_prompt_tokens or cached
    return {"ttft": ttft, "tokens": tokens, "cached": cached}


async def worker_loads(stack) -> dict:
    """Every worker's GetLoad, by name."""
    from tandem.v1 import worker_pb2, worker_pb2_grpc

    out = {}
    for p in stack.workers():
        async with stack.worker_channel(p) as ch:
            out[p.name] = await worker_pb2_grpc.WorkerStub(ch).GetLoad(
                worker_pb2.GetLoadRequest(), timeout=30)
    return out


class TierPeaks:
    """Each worker's host tier through a run, from GetLoad samples: the most bytes of KV it
    held and of host memory it had taken, and its size."""

    def __init__(self) -> None:
        self.peaks: dict[str, dict[str, int]] = {}

    def add(self, loads: dict) -> None:
        for name, load in loads.items():
            pk = self.peaks.setdefault(name, {"used": 0, "allocated": 0, "capacity": 0})
            pk["used"] = max(pk["used"], load.host_kv_bytes_used)
            pk["allocated"] = max(pk["allocated"], load.host_kv_bytes_allocated)
            pk["capacity"] = max(pk["capacity"], load.host_kv_capacity_bytes)

    async def sample(self, stack, stop: asyncio.Event, every_s: float = 0.25) -> None:
        """Sample until `stop` is set (a background task beside a wave)."""
        while not stop.is_set():
            self.add(await worker_loads(stack))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)


def is_idle(load) -> bool:
    """No request, no lease, every block free (cached blocks count as free)."""
    return (load.num_running == 0 and load.num_waiting == 0 and load.num_leases == 0
            and load.num_free_blocks == load.num_blocks)


async def wait_idle(stack, timeout_s: float = 30.0) -> dict[str, bool]:
    """Each worker's pool back to its idle count within timeout_s (leases are released
    asynchronously after the last answer), by name."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = await worker_loads(stack)
        idle = {name: is_idle(load) for name, load in loads.items()}
        if all(idle.values()) or time.monotonic() > deadline:
            return idle
        await asyncio.sleep(0.2)


async def run_waves(stack, a: argparse.Namespace, convs: list[list[list[int]]]) -> dict:
    import grpc

    from tandem.v1 import api_pb2_grpc

    history: list[list[int]] = [[] for _ in convs]
    turns, outputs = [], []
    rng = random.Random(a.seed)
    peaks = TierPeaks()
    async with grpc.aio.insecure_channel(stack.router.address) as ch:
        stub = api_pb2_grpc.TandemStub(ch)
        for t in range(a.turns):
            prompts = [h + c[t] for h, c in zip(history, convs)]
            place = rng.sample(range(len(prompts)), len(prompts))  # conversation -> its place
            before = await counters(stack)

            async def send(k: int, prompt: list[int]) -> dict:
                await asyncio.sleep(k / a.rate)  # a steady rate within the wave
                return await one(stub, prompt, a.output_tokens)

            stop = asyncio.Event()
            sampler = asyncio.create_task(peaks.sample(stack, stop))
            try:
                results = await asyncio.gather(*(send(place[i], p)
                                                 for i, p in enumerate(prompts)))
            finally:
                stop.set()
                await sampler
            after = await counters(stack)
            n = len(prompts)
            ttfts = [r["ttft"] * 1e3 for r in results]
            turns.append({
                "turn": t + 1, "prompt_tokens": sum(map(len, prompts)) / n,
                "new_tokens": sum(len(c[t]) for c in convs) / n
                + (a.output_tokens if t else 0),
                "kv_bytes": (after["bytes"] - before["bytes"]) / n,
                "kv_blocks": (after["blocks"] - before["blocks"]) / n,
                "computed": (after["computed"] - before["computed"]) / n,
                "restored": (after["restored"] - before["restored"]) / n,
                "cached": sum(r["cached"] for r in results) / n,
                "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99)})
            outputs.append([r["tokens"] for r in results])
            history = [p + r["tokens"] for p, r in zip(prompts, results)]
            print(f"  turn {t + 1}: {turns[-1]['kv_bytes'] / 1024:.1f} KiB pulled, "
                  f"{turns[-1]['computed']:.0f} tokens computed, "
                  f"{turns[-1]['restored']:.1f} blocks from host tiers per request", flush=True)
        idle = await wait_idle(stack)
        peaks.add(await worker_loads(stack))
    return {"turns": turns, "outputs": outputs, "idle": idle, "tier_peaks": peaks.peaks}


# -- what is compared, and the pools ---------------------------------------------------------
def block_size(a: argparse.Namespace) -> int:
    args = a.worker_args
    return int(args[args.index("--block-size") + 1]) if "--block-size" in args else 16


def conversation_blocks(a: argparse.Namespace) -> int:
    """KV blocks one conversation holds at its last turn: its prompt and answer."""
    tokens = a.first_tokens + (a.turns - 1) * (a.output_tokens + a.new_tokens) + a.output_tokens
    return -(-tokens // block_size(a))


def kv_block_bytes(a: argparse.Namespace) -> int:
    """Bytes of one pool block of the model in --dtype: all layers, K and V."""
    import torch

    from tandem.engine.config import ModelConfig
    from tandem.engine.model_source import resolve_model

    cfg = ModelConfig.from_dir(resolve_model(a.model))
    elem = torch.empty((), dtype=getattr(torch, a.dtype)).element_size()
    return cfg.num_layers * 2 * block_size(a) * cfg.num_kv_heads * cfg.head_dim * elem


def pool_blocks(a: argparse.Namespace, workers: int) -> int | None:
    """--num-blocks for each of `workers` workers of a role under --oversubscribe (None: the
    workers size their pools themselves)."""
    if a.oversubscribe is None:
        return None
    total = a.num_conversations * conversation_blocks(a)
    n = -(-total // int(a.oversubscribe * workers))
    if n <= conversation_blocks(a):
        raise SystemExit(f"--oversubscribe {a.oversubscribe}: a pool of {n} blocks cannot hold "
                         f"one conversation ({conversation_blocks(a)} blocks); use more "
                         "--num-conversations or a smaller ratio")
    return n


def tier_gb(a: argparse.Namespace) -> float:
    """Each worker's host tier, GiB: the flag's, or 1.25x the largest share of the
    conversations' KV at their last turn a worker of either role has."""
    if a.host_kv_cache_gb is not None:
        return a.host_kv_cache_gb
    share = a.num_conversations * conversation_blocks(a) / min(a.num_prefill, a.num_decode)
    return 1.25 * share * kv_block_bytes(a) / (1 << 30)


def variants(a: argparse.Namespace) -> dict[str, tuple[list[str], list[str]]]:
    """The runs to make, by label ("off", "on"): every worker's extra flags and the decode
    workers'."""
    if a.host_tier:
        table = {"off": (["--host-kv-cache-gb", "0"], []),
                 "on": (["--host-kv-cache-gb", f"{tier_gb(a):.6f}"], [])}
        which = a.host_tier
    else:
        table = {"off": ([], ["--no-prefix-caching"]), "on": ([], [])}
        which = a.reuse
    return {k: v for k, v in table.items() if which in (k, "both")}


def launch(a: argparse.Namespace, label: str, every: list[str], decode: list[str]):
    from tandem.cli.launcher import LocalStack

    roles = ["prefill"] * a.num_prefill + ["decode"] * a.num_decode
    if a.device == "cuda":
        import torch

        gpus = max(1, torch.cuda.device_count())
        devices = [f"cuda:{i % gpus}" for i in range(len(roles))]
    else:
        devices = ["cpu"] * len(roles)
    transport = a.transport or transports.default_for(a.device)
    common = ["--dtype", a.dtype, "--load-format", a.load_format, "--max-model-len",
              str(a.max_model_len), *a.worker_args, *every]
    pools = {role: (["--num-blocks", str(n)] if (n := pool_blocks(a, k)) else [])
             for role, k in (("prefill", a.num_prefill), ("decode", a.num_decode))}
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    bs = ["--block-size", str(block_size(a))] if "--block-size" in a.worker_args else []
    stack = LocalStack(a.model, roles, devices, worker_args=common,
                       role_args={"prefill": ["--transport", transport, *pools["prefill"]],
                                  "decode": [*decode, *pools["decode"]]},
                       router_args=["--grpc-port", "0", "--http-port", "-1",
                                    "--max-model-len", str(a.max_model_len), *bs,
                                    *(["--routing-policy", a.routing_policy]
                                      if a.routing_policy else [])],
                       log_dir=a.log_dir / f"{a.compare.replace(' ', '-')}-{label}"
                       if a.log_dir else None, env=env)
    return stack.start(), devices, transport


def print_table(runs: dict[str, dict], compare: str) -> None:
    off, on = runs.get("off"), runs.get("on")
    print()
    print(f"{'turn':>4}{'prompt':>8}{'new':>6} | {'KiB moved':>10}{'blocks':>8}"
          f"{'computed':>9}{'restored':>9}{'TTFT p50':>9}{'p99':>7}"
          + (f" | {compare} on" if off and on else ""))
    for label, run in runs.items():
        print(f"-- {compare} {label}")
        for t in run["turns"]:
            ratio = ""
            if label == "on" and off:
                base = off["turns"][t["turn"] - 1]
                ratio = f"  {base['kv_bytes'] / t['kv_bytes']:.1f}x fewer bytes" \
                    if t["kv_bytes"] else "  (nothing moved)"
                if compare == "host tier":
                    ratio += f", {base['computed'] / max(t['computed'], 1):.1f}x fewer computed"
            print(f"{t['turn']:>4}{t['prompt_tokens']:>8.0f}{t['new_tokens']:>6.0f} | "
                  f"{t['kv_bytes'] / 1024:>10.1f}{t['kv_blocks']:>8.1f}{t['computed']:>9.1f}"
                  f"{t['restored']:>9.1f}{t['ttft_p50']:>9.0f}{t['ttft_p99']:>7.0f}{ratio}")


def print_after(label: str, run: dict, compare: str) -> dict:
    """The pools' idle check and the tiers' peaks against their size, after one run."""
    busy = sorted(name for name, ok in run["idle"].items() if not ok)
    print(f"{compare} {label}: pools idle after the run: "
          f"{'all' if not busy else 'NOT ' + ', '.join(busy)}")
    over = {}
    for name, pk in sorted(run["tier_peaks"].items()):
        if not pk["capacity"]:
            continue
        print(f"  {name}: host tier peak {pk['used'] / 2**20:.1f} MiB held, "
              f"{pk['allocated'] / 2**20:.1f} MiB taken, of {pk['capacity'] / 2**20:.1f} MiB")
        if max(pk["used"], pk["allocated"]) > pk["capacity"]:
            over[name] = pk
    return {"idle": not busy, "tier_within_bound": not over}


def index_memory(n: int = 1_000_000, workers: int = 8) -> float:
    """Bytes per hash of the router's KVIndex holding n hashes spread over `workers` workers
    (each hash a fresh int, as the protobuf decoder makes them)."""
    import tracemalloc

    from tandem.router_svc.kv_index import KVIndex

    rng = random.Random(0)
    batches = [[rng.getrandbits(64) - (1 << 63) for _ in range(n // workers)]
               for _ in range(workers)]
    tracemalloc.start()
    idx = KVIndex(max_blocks=2 * n)
    base = tracemalloc.get_traced_memory()[0]
    for slot, hashes in enumerate(batches):
        idx.apply(slot, (int(str(h)) for h in hashes), [])  # fresh int objects
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return used / len(idx)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.index_memory:
        per = index_memory()
        print(f"router KV map: {per:.1f} bytes per cached block hash, "
              f"{per:.0f} MB for 1M blocks")
        return 0
    if a.host_tier and a.reuse not in (None, "on"):
        parser.error("--host-tier compares with reuse on (the tier lives under the prefix "
                     "cache): leave --reuse out")
    if a.oversubscribe is not None and "--num-blocks" in a.worker_args:
        parser.error("--oversubscribe sizes the pools: leave --num-blocks out")
    a.reuse = a.reuse or ("on" if a.host_tier else "both")
    a.compare = "host tier" if a.host_tier else "reuse"
    from benchmarks.lib.common import model_vocab

    vocab, _ = model_vocab(a.model)
    convs = conversations(a, vocab)
    if a.oversubscribe is not None:
        print(f"pools: {pool_blocks(a, a.num_prefill)} blocks a prefill worker, "
              f"{pool_blocks(a, a.num_decode)} a decode worker; the conversations hold "
              f"{a.num_conversations * conversation_blocks(a)} at their last turn", flush=True)
    runs: dict[str, dict] = {}
    meta: dict = {"compare": a.compare}
    for label, (every, decode) in variants(a).items():
        print(f"{a.compare} {label}: starting {a.num_prefill} prefill + {a.num_decode} decode "
              f"workers {' '.join(every)}", flush=True)
        stack, devices, transport = launch(a, label, every, decode)
        try:
            runs[label] = asyncio.run(run_waves(stack, a, convs))
        finally:
            stack.stop()
        meta.update(devices=devices, transport=transport)
    print_table(runs, a.compare)
    print()
    meta["after"] = {label: print_after(label, run, a.compare) for label, run in runs.items()}
    meta["tier_peaks"] = {label: run["tier_peaks"] for label, run in runs.items()}
    if len(runs) == 2:
        same = sum(x == y for t_off, t_on in zip(runs["off"]["outputs"], runs["on"]["outputs"])
                   for x, y in zip(t_off, t_on))
        total = sum(len(t) for t in runs["on"]["outputs"])
        print(f"\noutputs identical with and without {a.compare}: {same}/{total}")
        meta["identical_outputs"] = [same, total]
    if a.out:
        report = {"args": {k: str(v) for k, v in vars(a).items()}, **meta,
                  "runs": {k: v["turns"] for k, v in runs.items()}}
        a.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
