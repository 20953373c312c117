"""Moving one running request, live, with the decode worker's Move RPC (`tandem move`): the
request goes on on the other decode worker token for token (greedy and seeded sampled alike),
its KV pulled from the first one; the worker it left is not draining, keeps its other requests
and takes new ones; the router's log says the move was an operator's. Move answers NOT_FOUND
for a request the worker does not run and FAILED_PRECONDITION on a prefill worker. Every pool
ends idle. Processes on 127.0.0.1 (shm transport)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest

from cluster import WORKER_ARGS, Cluster
from tandem.engine.sampling_params import SamplingParams
from tandem.runtime.convert import params_to_proto
from tandem.v1 import api_pb2, worker_pb2, worker_pb2_grpc

PROMPTS = [[(3 * i + 17 * j) % 250 + 1 for j in range(12 + 5 * i)] for i in range(2)]
LONG = 384  # tokens: most likely still running when the move lands (else tried again)
PARAMS = [SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=LONG, ignore_eos=True)]
ROUNDS = 4  # rounds at most until a request moved before it ended


class Running:
    """One Generate call with a request id of ours, read in a task."""

    def __init__(self, stub, rid: str, prompt: list[int], params: SamplingParams) -> None:
        self.tokens: list[int] = []
        self.some = asyncio.Event()  # a few tokens came: it runs on its decode worker
        self.task = asyncio.create_task(self._read(stub.Generate(api_pb2.GenerateRequest(
            request_id=rid, token_ids=api_pb2.TokenIds(ids=prompt),
            params=params_to_proto(params)))))

    async def _read(self, call) -> list[int]:
        async for chunk in call:
            self.tokens += chunk.token_ids
            if len(self.tokens) >= 4:
                self.some.set()
        return self.tokens


@pytest.mark.timeout(300)
def test_move_moves_one_request_live_and_nothing_else(tiny_models, tmp_path):
    """Each round: a greedy and a seeded request, each sent twice (a twin, never moved, is the
    reference: the same prompt and parameters make the same tokens), all at once; each
    original is asked to move once streaming (Move on both decode workers: the one not
    running it answers NOT_FOUND). Rounds until a move landed before its request ended."""
    c = Cluster(tmp_path, str(tiny_models["llama"]), decode=2, worker_args=WORKER_ARGS).start()
    decode = {w.address: w for w in c.workers("decode")}
    try:
        async def move(address: str, rid: str) -> worker_pb2.MoveResponse | grpc.StatusCode:
            """Move's answer, or the status it failed with."""
            async with grpc.aio.insecure_channel(address) as ch:
                try:
                    return await worker_pb2_grpc.WorkerStub(ch).Move(
                        worker_pb2.MoveRequest(request_id=rid), timeout=120)
                except grpc.aio.AioRpcError as e:
                    return e.code()

        async def one_round(stub, k: int):
            runs = {f"r{k}-{i}{twin}": Running(stub, f"r{k}-{i}{twin}", p, params)
                    for i, (p, params) in enumerate(zip(PROMPTS, PARAMS, strict=True))
                    for twin in ("", "-twin")}
            for r in runs.values():  # a request that failed says so here
                some = asyncio.ensure_future(r.some.wait())
                await asyncio.wait([some, r.task], return_when=asyncio.FIRST_COMPLETED)
                some.cancel()
                if r.task.done():
                    r.task.result()
            asks = [(rid, a) for rid in runs if not rid.endswith("-twin") for a in decode]
            answers = dict(zip(asks, await asyncio.gather(*(move(a, rid) for rid, a in asks)),
                               strict=True))
            results = {rid: await r.task for rid, r in runs.items()}
            return answers, results

        async def main():
            async with grpc.aio.insecure_channel(c.router.address) as ch:
                stub = c.api(ch)
                async with c.worker_channel(c.procs["prefill0"]) as pch:
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await worker_pb2_grpc.WorkerStub(pch).Move(
                            worker_pb2.MoveRequest(request_id="r"))
                    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                rounds = []
                for k in range(ROUNDS):
                    rounds.append(await one_round(stub, k))
                    if any(getattr(r, "moved", False) for r in rounds[-1][0].values()):
                        break
                await c.wait_idle(timeout=60)
                loads = {a: await c.load(w) for a, w in decode.items()}
                return rounds, loads

        rounds, loads = asyncio.run(main())
        for _, results in rounds:
            for rid, tokens in results.items():
                if not rid.endswith("-twin"):
                    assert tokens == results[f"{rid}-twin"], rid
                    assert len(tokens) == LONG
        answers, _ = rounds[-1]
        moved = [(rid, a) for (rid, a), r in answers.items() if getattr(r, "moved", False)]
        assert moved
        for (rid, a), r in answers.items():  # the worker not running it
            if isinstance(r, grpc.StatusCode):
                assert r == grpc.StatusCode.NOT_FOUND, (rid, a, r)
        events = [line["event"] for line in c.router.json_logs()]
        for rid, src in moved:
            assert answers[rid, src].num_tokens > len(PROMPTS[0])  # generated tokens' KV too
            (dst,) = set(decode) - {src}
            assert loads[dst].migrations_in >= 1 and loads[dst].kv_blocks_migrated > 0
            assert any(e.startswith(f"moved {rid} live from {src} to {dst} (operator;")
                       for e in events), events[-10:]
        # It moved single requests, and drained nothing.
        assert not any(ld.draining for ld in loads.values())
        assert [e for e in c.router.json_logs() if e.get("level") in ("error", "critical")] \
            == []
    finally:
        codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


def test_tandem_move_with_no_worker_there_exits_1():
    from cluster import free_port

    done = subprocess.run([sys.executable, "-m", "tandem.cli.move", f"127.0.0.1:{free_port()}",
                           "some-request", "--timeout", "5"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and "UNAVAILABLE" in done.stderr
