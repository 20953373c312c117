"""The stall a live migration costs: one long request moved between decode workers while it and
--others shorter requests stream from the same worker, measured from the client's side.

    # CPU, tandem-demo (shm): a few hundred prompt tokens, under a minute
    python benchmarks/serving/migration_stall.py
    # two GPUs, 8B config, a 32k-token sequence (cuda_ipc): prefill0 + decode0 on cuda:0,
    # decode1 on cuda:1
    python benchmarks/serving/migration_stall.py --model benchmarks/configs/llama-3.1-8b \\
        --load-format dummy --dtype bfloat16 --device cuda --max-model-len 34816 --out s.json

One stack, one sitting: prefill0, decode0 and decode1 (the layout above on GPUs), and a router
that knows decode0 alone at first (--workers-file), so every request is placed there. Two runs
of the same requests (greedy, ignore_eos), each the long one (--long-tokens prompt tokens,
--long-max-tokens out) and --others shorter streams, all on decode0:
  reference  nothing moves;
  moved      once the long one has streamed --move-after tokens and the router routes to
             decode1 (added to its workers file after the requests were placed), decode0 is
             asked to move it (the worker's Move RPC, `tandem move`): decode0 lends its KV,
             decode1 pulls it while decode0 decodes on, the router hands it over.
Every token's arrival time is recorded per stream. Reported: the decode step before the move
(the long request's median inter-token gap, per token of each chunk), the longest gap of the moved request and of the
others from the move's start to --window steps after the first token past its hand-over, in steps (the same window
of the reference run beside them: a gap of 1 step is no stall), the time from the move's start
to hand-over (Move's answer: decode0 lent the KV until the router took the request away), and
whether every stream's tokens equal the reference run's.

Where the moved request's gap goes (the switch), on the host's monotonic clock that the router's
and decode1's log lines carry (`timing={...}`: router_svc/live_migration.py, engine/migration.py
Resumed), from the last token the client got from decode0: decode1 parked the request (its KV
pulled), the router got decode1's ready, sent the HandOver, decode1's worker got it, its engine
applied it, started the step that computes the tail (the tokens decode0 made after lending its
KV: as decode rows or a chunk), sampled the first token; the router got it, then the client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.lib.common import device_name, environment, model_vocab  # noqa: E402

BLOCK = 16  # tokens per KV block (the workers' default)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", default="tandem-demo")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: prefill0 and decode0 on cuda:0, decode1 on cuda:1")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--long-tokens", type=int, default=None,
                   help="the long request's prompt tokens (default: 32768 on cuda, 300 on cpu)")
    p.add_argument("--long-max-tokens", type=int, default=None,
                   help="its output tokens, and the others' (default: 1024 on cuda, 192 on cpu)")
    p.add_argument("--others", type=int, default=3, help="shorter streams beside it")
    p.add_argument("--other-tokens", type=int, default=64, help="their prompt tokens")
    p.add_argument("--move-after", type=int, default=None,
                   help="tokens the long request has streamed when the move is asked "
                        "(default: 64 on cuda, 24 on cpu)")
    p.add_argument("--window", type=int, default=20,
                   help="steps after the hand-over that the stall window takes in")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="each worker's KV pool (default: room for every request twice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON results")
    p.add_argument("--log-dir", type=Path, default=None)
    return p


def defaults(a: argparse.Namespace) -> None:
    gpu = a.device == "cuda"
    for name, on_gpu, on_cpu in (("long_tokens", 32768, 300), ("long_max_tokens", 1024, 192),
                                 ("move_after", 64, 24)):
        if getattr(a, name) is None:
            setattr(a, name, on_gpu if gpu else on_cpu)
    if a.move_after >= a.long_max_tokens:
        raise SystemExit("--move-after must be below --long-max-tokens")
    if a.num_blocks is None:
        tokens = (a.long_tokens + a.long_max_tokens
                  + a.others * (a.other_tokens + a.long_max_tokens))
        a.num_blocks = 2 * (tokens // BLOCK + a.others + 1) + 64


# -- one stream, as the client sees it ------------------------------------------------------------
@dataclass
class Stream:
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # each token's arrival (monotonic)
    first: asyncio.Event = field(default_factory=asyncio.Event)
    grew: asyncio.Event = field(default_factory=asyncio.Event)


async def stream(stub, rid: str, prompt: list[int], max_tokens: int, s: Stream) -> Stream:
    from tandem.v1 import api_pb2, common_pb2

    msg = api_pb2.GenerateRequest(request_id=rid, token_ids=api_pb2.TokenIds(ids=prompt),
                                  params=common_pb2.SamplingParams(
                                      max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
    async for chunk in stub.Generate(msg, timeout=1800):
        now = time.monotonic()
        for tok in chunk.token_ids:  # tokens of one chunk came together
            s.tokens.append(tok)
            s.times.append(now)
        if s.tokens:
            s.first.set()
            s.grew.set()
    return s


def gaps_in(s: Stream, t0: float, t1: float) -> list[float]:
    """The inter-token gaps of tokens arriving in (t0, t1] (the first one's gap reaches back
    to the token before it)."""
    return [b - a for a, b in pairwise(s.times) if t0 < b <= t1]


def step_time(s: Stream, t0: float) -> float:
    """The decode step before t0: the median, over the chunks that came before it (past the
    first quarter's warm-up), of the gap before each chunk per token it carried. A chunk is one
    step's tokens unless the client or the router fell behind, when several steps' come as one
    (then the plain median of inter-token gaps would read 0)."""
    chunks: list[tuple[float, int]] = []  # (arrival, tokens)
    for t in s.times:
        if chunks and chunks[-1][0] == t:
            chunks[-1] = (t, chunks[-1][1] + 1)
        else:
            chunks.append((t, 1))
    per_token = [(b - a) / n for (a, _), (b, n) in pairwise(chunks) if b <= t0]
    return statistics.median(per_token[len(per_token) // 4:])


async def warm_directly(worker, prompt: list[int]) -> None:
    """A few steps on a decode worker the router does not route to yet: a request without a
    lease, prefilled and decoded there (its Stream call), read to its end."""
    from tandem.engine.sampling_params import SamplingParams
    from tandem.runtime.convert import params_to_proto
    from tandem.v1 import worker_pb2

    params = params_to_proto(SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    done = asyncio.Event()

    async def sent():
        yield worker_pb2.StreamRequest(decode=worker_pb2.DecodeRequest(
            request_id="warmup-decode1", prompt_token_ids=prompt, params=params))
        await done.wait()  # the call stays open until the request has ended

    call = worker.Stream(sent())
    try:
        async for m in call:
            if any(u.request_id == "warmup-decode1" and u.done for u in m.updates):
                break
    finally:
        done.set()
        call.cancel()


# -- the stack -------------------------------------------------------------------------------------
def write_members(path: Path, lines: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{line}\n" for line in lines))
    os.replace(tmp, path)


def start_stack(a: argparse.Namespace):
    from tandem.cli.launcher import LocalStack

    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    stack = LocalStack(a.model, [], [], log_dir=a.log_dir, env=env)
    engine = ["--model", a.model, "--port", "0", "--num-blocks", str(a.num_blocks),
              "--load-format", a.load_format]
    engine += ["--dtype", a.dtype] if a.dtype else []
    engine += ["--max-model-len", str(a.max_model_len)] if a.max_model_len else []
    procs = {}
    layout = (("prefill0", "prefill", "cuda:0"), ("decode0", "decode", "cuda:0"),
              ("decode1", "decode", "cuda:1"))
    for name, role, gpu in layout:
        device = gpu if a.device == "cuda" else "cpu"
        cpu = ["--cpu-threads", "1"] if device == "cpu" else []
        procs[name] = stack.spawn(name, ["worker", "--role", role, "--device", device,
                                         *engine, *cpu])
        if name == "prefill0" and device != "cpu":  # decode0 shares its GPU: started after
            stack.wait_ready([procs[name]])       # it, when its memory is taken
    stack.wait_ready(list(procs.values()))
    members = stack.log_dir / "workers"
    write_members(members, [f"prefill {procs['prefill0'].address}",
                            f"decode {procs['decode0'].address}"])
    router = ["router", "--model", a.model, "--workers-file", str(members),
              "--membership-interval", "0.1", "--poll-interval", "0.2", "--grpc-port", "0",
              "--http-port", "0"]
    router += ["--max-model-len", str(a.max_model_len)] if a.max_model_len else []
    procs["router"] = stack.spawn("router", router)
    stack.wait_ready([procs["router"]])
    return stack, procs, members


async def routed(h, address: str) -> None:
    """Until the router's /workers lists `address` up."""
    while True:
        ws = (await h.get("/workers")).json()["workers"]
        if any(w["address"] == address and w["state"] == "up" for w in ws):
            return
        await asyncio.sleep(0.05)


# -- the runs --------------------------------------------------------------------------------------
async def one_run(a, stub, prompts: dict[str, list[int]], tag: str, before_move=None,
                  move=None) -> tuple[dict[str, Stream], dict | None]:
    """Every request at once (the long one first); with `move`, once the long one has
    streamed --move-after tokens, `before_move()` then `move(rid)`: Move's answer and when it
    was asked."""
    streams = {name: Stream() for name in prompts}
    tasks = [asyncio.create_task(stream(stub, f"{name}-{tag}", p, a.long_max_tokens,
                                        streams[name]))
             for name, p in prompts.items()]
    moved = None
    if move is not None:
        for s in streams.values():
            await s.first.wait()  # every request placed (on decode0)
        await before_move()
        long = streams["long"]
        while len(long.tokens) < a.move_after:
            long.grew.clear()
            await long.grew.wait()
        t0, then = time.monotonic(), len(long.tokens)  # before Move answers: at the ask
        resp = await move(f"long-{tag}")
        moved = {"t0": t0, "t1": time.monotonic(), "moved": resp.moved,
                 "seconds": resp.seconds, "num_tokens": resp.num_tokens,
                 "tokens_then": then}
    await asyncio.gather(*tasks)
    return streams, moved


async def measure(a: argparse.Namespace, procs: dict, members: Path, log_dir: Path) -> dict:
    import grpc
    import httpx

    from tandem.v1 import api_pb2_grpc, worker_pb2, worker_pb2_grpc

    vocab, _ = model_vocab(a.model)
    rng = random.Random(a.seed)
    hi = min(vocab, 32000) - 1
    prompts = {"long": [rng.randint(1, hi) for _ in range(a.long_tokens)]}
    for i in range(a.others):
        prompts[f"other{i}"] = [rng.randint(1, hi) for _ in range(a.other_tokens)]
    p0, d0, d1, router = (procs[n] for n in ("prefill0", "decode0", "decode1", "router"))

    async with grpc.aio.insecure_channel(router.address) as ch, \
            grpc.aio.insecure_channel(d0.address) as w0, \
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}") as h:
        stub = api_pb2_grpc.TandemStub(ch)
        worker0 = worker_pb2_grpc.WorkerStub(w0)
        # Warm-up: each shape's first steps (and the prefix cache holds nothing of the runs'),
        # on decode0 through the router and on decode1 directly (a destination that has served
        # before, as in a running deployment: its first step is not the process's first).
        warm = prompts["other0"][:8] if a.others else [1, 2, 3]
        await stream(stub, "warmup", warm, 8, Stream())
        async with grpc.aio.insecure_channel(d1.address) as w1:
            await warm_directly(worker_pb2_grpc.WorkerStub(w1), warm)
        ref, _ = await one_run(a, stub, prompts, "ref")

        async def add_decode1() -> None:
            write_members(members, [f"prefill {p0.address}", f"decode {d0.address}",
                                    f"decode {d1.address}"])
            await routed(h, d1.address)

        async def move(rid: str):
            return await worker0.Move(worker_pb2.MoveRequest(request_id=rid), timeout=600)

        runs, mv = await one_run(a, stub, prompts, "moved", add_decode1, move)
        async with grpc.aio.insecure_channel(d1.address) as w1:
            l1 = await worker_pb2_grpc.WorkerStub(w1).GetLoad(worker_pb2.GetLoadRequest())
    return report(a, ref, runs, mv, l1, switch_timing(log_dir, "long-moved"))


# -- the switch's timing, from the logs ------------------------------------------------------------
TIMING = re.compile(r"timing=(\{.*?\})")
# (field, what happened then), in order; "client_last" and "client_first" are the client's.
SWITCH = (("client_last", "client got decode0's last token"),
          ("parked", "decode1 parked it (KV pulled)"),
          ("ready", "router got decode1's ready"),
          ("handover_sent", "router sent the HandOver"),
          ("received", "decode1's worker got it"),
          ("applied", "decode1's engine applied it"),
          ("scheduled", "the tail's step started"),
          ("first_token", "decode1 sampled the first token"),
          ("router_first_token", "router got it"),
          ("client_first", "client got it"))


def logged_timing(path: Path, rid: str) -> dict:
    """The `timing={...}` fields of the log lines about request `rid` in a service's log (JSON
    lines, or plain text), merged."""
    got: dict = {}
    if not path.exists():
        return got
    for line in path.read_text(errors="replace").splitlines():
        if rid not in line or "timing=" not in line:
            continue
        with contextlib.suppress(ValueError, AttributeError):  # a JSON line: its message
            line = json.loads(line).get("event", line)
        m = TIMING.search(line)
        if m:
            got.update(json.loads(m.group(1)))
    return got


def switch_timing(log_dir: Path, rid: str) -> dict:
    """The router's and decode1's timing of the long request's switch (empty where a log has
    none: a worker without the timing log)."""
    return {**logged_timing(log_dir / "router.log", rid),
            **logged_timing(log_dir / "decode1.log", rid)}


def switch_rows(long: Stream, timing: dict, step: float) -> list[tuple[str, str, float]]:
    """(field, what, ms after the client's last decode0 token) for each known moment, the
    client's two tokens around the switch placed by the count the router had handed over."""
    k = timing.get("tokens_so_far")
    if not k or k >= len(long.times):
        return []
    t = {**timing, "client_last": long.times[k - 1], "client_first": long.times[k]}
    return [(f, what, (t[f] - t["client_last"]) * 1e3) for f, what in SWITCH if t.get(f)]


def report(a, ref: dict[str, Stream], runs: dict[str, Stream], mv: dict, l1,
           timing: dict) -> dict:
    long = runs["long"]
    step = step_time(long, mv["t0"])
    k = sum(t <= mv["t0"] for t in long.times)  # the mean gap before the move, past warm-up
    tpot = (long.times[k - 1] - long.times[k // 4]) / max(k - 1 - k // 4, 1)
    # From the hand-over's first token on (a slow one would otherwise fall past the window).
    after = [t for t in long.times if t > mv["t1"]]
    end = (after[0] if after else mv["t1"]) + a.window * step
    # The reference run's matching window: the same token positions of the long request.
    k0, k1 = mv["tokens_then"], sum(t <= end for t in long.times)
    r_long = ref["long"]
    r_t0, r_t1 = r_long.times[k0 - 1], r_long.times[min(k1, len(r_long.times)) - 1]
    rows = {}
    for name in runs:
        moved_gaps = gaps_in(runs[name], mv["t0"], end)
        ref_gaps = gaps_in(ref[name], r_t0, r_t1)
        rows[name] = {"longest_gap_steps": max(moved_gaps, default=0.0) / step,
                      "reference_longest_gap_steps": max(ref_gaps, default=0.0) / step,
                      "tokens_equal_reference": runs[name].tokens == ref[name].tokens,
                      "tokens": len(runs[name].tokens)}
    others = [r for n, r in rows.items() if n != "long"]
    return {"step_ms": step * 1e3, "tpot_before_ms": tpot * 1e3, "move": {k: v for k, v in mv.items()
                                            if k not in ("t0", "t1")},
            "move_to_handover_ms": mv["seconds"] * 1e3,
            "long_stall_steps": rows["long"]["longest_gap_steps"] - 1,
            "others_stall_steps": max((r["longest_gap_steps"] for r in others),
                                      default=1.0) - 1,
            "switch": {"timing": timing, "tail_tokens": timing.get("tail_tokens"),
                       "tail_as_decode_rows": timing.get("decode_rows"),
                       "ms_after_last_source_token": {
                           f: ms for f, _, ms in switch_rows(long, timing, step)}},
            "decode1_migrations_in": l1.migrations_in,
            "decode1_kv_blocks_migrated": l1.kv_blocks_migrated,
            "streams": rows}


def print_table(a, r: dict) -> None:
    mv = r["move"]
    print(f"\nlong request: {a.long_tokens} prompt tokens, moved after {mv['tokens_then']} "
          f"of {a.long_max_tokens} output tokens ({mv['num_tokens']} tokens' KV lent); "
          f"{a.others} other streams on the same decode worker")
    print(f"decode step before the move (long request's median gap): {r['step_ms']:.2f} ms "
          f"(mean {r['tpot_before_ms']:.2f} ms)")
    if r["step_ms"] < r["tpot_before_ms"] / 2:
        print("  tokens came in bursts (this client, or the router, fell behind the steps): "
              "the gaps below do not measure the workers")
    print(f"move asked -> handed over: {r['move_to_handover_ms']:.1f} ms "
          f"(moved: {mv['moved']}; decode1 pulled {r['decode1_kv_blocks_migrated']} blocks)")
    print(f"\n{'stream':<8} {'longest gap (steps)':>20} {'same window, no move':>21} "
          f"{'tokens = no move':>17}")
    for name, row in r["streams"].items():
        print(f"{name:<8} {row['longest_gap_steps']:>20.2f} "
              f"{row['reference_longest_gap_steps']:>21.2f} "
              f"{row['tokens_equal_reference']!s:>17}")
    print(f"\nstall (longest gap - 1 step): moved request {r['long_stall_steps']:.2f} steps, "
          f"others {r['others_stall_steps']:.2f} steps")
    print_switch(r)


def print_switch(r: dict) -> None:
    sw = r["switch"]
    ms = sw["ms_after_last_source_token"]
    if not ms:
        print("\nswitch: no timing in the router's and decode1's logs")
        return
    tail = sw["tail_tokens"]
    how = "decode rows" if sw["tail_as_decode_rows"] else "a chunk"
    print(f"\nthe moved request's switch (tail: {tail} tokens as {how}), ms after the client's "
          f"last token from decode0 (steps of {r['step_ms']:.2f} ms):")
    prev = None
    for f, what in sorted((x for x in SWITCH if x[0] in ms), key=lambda x: ms[x[0]]):
        since = "" if prev is None else f"  (+{ms[f] - prev:.2f})"
        print(f"  {what:<34} {ms[f]:>9.2f} ms {ms[f] / r['step_ms']:>6.2f} steps{since}")
        prev = ms[f]


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    defaults(a)
    card = device_name("cuda:0") if a.device == "cuda" else "cpu"
    print(f"migration stall: {a.model} on {card}; 1 prefill + 2 decode workers "
          f"({a.num_blocks} blocks each)", flush=True)
    stack, procs, members = start_stack(a)
    try:
        r = asyncio.run(measure(a, procs, members, stack.log_dir))
    finally:
        stack.stop()
    print_table(a, r)
    ok = r["move"]["moved"] and all(s["tokens_equal_reference"] for s in r["streams"].values())
    if a.out:
        a.out.write_text(json.dumps({"card": card, "args": {k: str(v) for k, v in vars(a).items()},
                                     "environment": environment(), **r}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
