"""Rebalance through a real stack over gRPC: requests pile onto the one decode worker the router
knows (decode0, a pool too small for them: requests wait there), then decode1 joins
(--workers-file). The router, with --rebalance, asks decode0 to lend running requests' KV
(StreamRequest.lend) and moves them live to decode1, which pulls their blocks; nothing is
replayed; the request spans say they moved for rebalance. Greedy and seeded sampled outputs
equal the offline engine's; every pool and lease ends idle. Processes on 127.0.0.1 (shm
transport)."""

from __future__ import annotations

import asyncio
import re
import time

import grpc
import httpx
import pytest
from test_drain import generate
from test_membership_stack import _until_logged, _write
from traces import attrs

from cluster import WORKER_ARGS, Cluster
from tandem.engine.sampling_params import SamplingParams

PROMPTS = [[(5 * i + 13 * j) % 250 + 1 for j in range(8 + 7 * i)] for i in range(4)]
LONG = 400  # tokens a sample: decode0 (32 blocks of 16) holds one whole
PARAMS = [SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=LONG, ignore_eos=True)]
TEMPLATES = [(p, PARAMS[i % 2]) for i, p in enumerate(PROMPTS)]
MOVES = 2  # live moves the test waits for (each counted as it happens)
ROUNDS = 4  # bursts at most until they happened


def _counter(text: str, name: str, labels: str) -> float:
    series = re.escape(name) + (rf"\{{{re.escape(labels)}\}}" if labels else "")
    m = re.search(rf"^{series} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.timeout(300)
def test_rebalance_moves_running_requests_live_to_a_decode_worker_with_room(tiny_models,
                                                                           tmp_path, offline,
                                                                           receiver):
    expected = [[o.token_ids for o in out.outputs] for out in offline.generate(
        [p for p, _ in TEMPLATES], [p for _, p in TEMPLATES])]
    model = str(tiny_models["llama"])
    c = Cluster(tmp_path, model, prefill=0, decode=0, env=receiver.env(schedule_delay_ms=50))
    try:
        workers = {}
        small = ["--num-blocks", "32"]  # after WORKER_ARGS: the last flag wins
        for name, role, extra in (("prefill0", "prefill", []), ("decode0", "decode", small),
                                  ("decode1", "decode", [])):
            workers[name] = c.spawn(name, ["worker", "--role", role, "--device", "cpu",
                                           "--model", model, "--port", "0", "--grace", "10",
                                           "--cpu-threads", "1", *WORKER_ARGS, *extra])
        c.wait_ready(list(workers.values()))
        p0, d0, d1 = workers["prefill0"], workers["decode0"], workers["decode1"]
        members = tmp_path / "workers"
        _write(members, [f"prefill {p0.address}", f"decode {d0.address}"])
        router = c.spawn("router", ["router", "--model", model, "--grace", "10",
                                    "--workers-file", str(members), "--membership-interval",
                                    "0.1", "--poll-interval", "0.1", "--grpc-port", "0",
                                    "--http-port", "0", "--rebalance",
                                    "--rebalance-free-fraction", "0.2",
                                    "--rebalance-max-moves", "2"])
        c.wait_ready([router])

        async def moved(h: httpx.AsyncClient) -> float:
            text = (await h.get("/metrics")).text
            return _counter(text, "tandem:rebalance_moves_total", 'outcome="moved"')

        async def burst(stub, h: httpx.AsyncClient) -> list:
            """The templates at once onto decode0 alone, decode1 added once requests wait
            there; until they end. decode1 is taken out again after (its requests done)."""
            runs = [asyncio.create_task(generate(stub, p, params)) for p, params in TEMPLATES]
            # decode0 alone takes them all; its pool holds one or two: the rest wait.
            while (await c.load(d0)).num_waiting == 0:
                assert not any(r.done() for r in runs)
                await asyncio.sleep(0.05)
            seen = len(router.json_logs())
            _write(members, [f"prefill {p0.address}", f"decode {d0.address}",
                             f"decode {d1.address}"])
            await _until_logged(router, f"worker {d1.address} (decode, ", seen)  # is up
            results = await asyncio.gather(*runs)
            seen = len(router.json_logs())
            _write(members, [f"prefill {p0.address}", f"decode {d0.address}"])
            await _until_logged(router, f"worker {d1.address} (decode) drained and removed",
                                seen)
            return results

        async def main():
            async with grpc.aio.insecure_channel(router.address) as ch, \
                    httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}") as h:
                stub = c.api(ch)
                assert await moved(h) == 0
                # Whether the moves happen before a burst ends is a race with decode0's steps
                # (a move waits for a poll round, a lend and a pull): bursts until they did.
                rounds = []
                while await moved(h) < MOVES and len(rounds) < ROUNDS:
                    rounds.append(await burst(stub, h))
                await c.wait_idle(timeout=60)
                return rounds, (await h.get("/metrics")).text

        rounds, metrics = asyncio.run(main())
        assert all(results == expected for results in rounds)
        assert _counter(metrics, "tandem:rebalance_moves_total", 'outcome="moved"') >= MOVES
        # Moved live, never by token replay.
        assert _counter(metrics, "tandem:live_migrations_total", 'outcome="replayed"') == 0
        assert _counter(metrics, "tandem:request_migrations_total", "") == 0

        async def loads():
            return await c.load(d0), await c.load(d1)

        l0, l1 = asyncio.run(loads())
        assert l1.migrations_in >= MOVES and l1.kv_blocks_migrated > 0  # decode1 pulled them
        assert l0.migrations_in == 0
        # The request's span says it moved and why.
        while not (moves := [attrs(e) for svc, span in receiver.snapshot()
                             if svc == "tandem-router" for e in span.events
                             if e.name == "live_migrated"]):
            time.sleep(0.05)
        assert {m["tandem.move.cause"] for m in moves} == {"rebalance"}
        assert {m["tandem.rebalance.reason"] for m in moves} <= {"waiting", "free_blocks"}
        assert all(m["tandem.worker.to"] == d1.address for m in moves)
        events = [e["event"] for e in router.json_logs()]
        assert any(f" live from {d0.address} to {d1.address} (rebalance;" in e for e in events)
        assert [e for e in router.json_logs() if e.get("level") in ("error", "critical")] == []
    finally:
        codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes
