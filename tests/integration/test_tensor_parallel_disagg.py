"""Prefill and decode at different tensor-parallel sizes, as real processes on 127.0.0.1 (gloo,
shm): each decode rank pulls the KV heads it owns from the prefill ranks holding them, under one
lease per request. Greedy outputs equal the colocated engine's at TP 1, and cancelled or killed
requests leave every pool idle (block ids are allocated by rank 0 for every rank's pool, so its
count is every rank's)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from cluster import HOLD_BLOCKS, HOLD_TOKENS, Cluster
from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams
from tandem.runtime.convert import params_to_proto
from tandem.v1 import api_pb2

# One torch thread per engine process: two workers of two ranks each share two cores.
WORKER_ARGS = ["--num-blocks", "128", "--max-num-batched-tokens", "64", "--cpu-threads", "1"]
PROMPTS = [[(13 * i + 7 * j) % 250 + 1 for j in range(4 + 9 * i)] for i in range(8)]
GREEDY = SamplingParams(temperature=0, max_tokens=20)
LAYOUTS = {"P2-D1": ("2", "1"), "P1-D2": ("1", "2")}


@pytest.fixture(scope="module")
def offline(tiny_models):
    """Colocated, TP 1: the reference."""
    with LLM(str(tiny_models["qwen2"]), progress=False, num_blocks=128) as llm:
        out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return out


@pytest.fixture(scope="module", params=list(LAYOUTS))
def cluster(request, tiny_models, tmp_path_factory):
    p_tp, d_tp = LAYOUTS[request.param]
    c = Cluster(tmp_path_factory.mktemp(request.param), str(tiny_models["qwen2"]),
                worker_args=WORKER_ARGS,
                prefill_args=["--lease-ttl", "5", "--tensor-parallel-size", p_tp],
                decode_args=["--tensor-parallel-size", d_tp],
                router_args=["--http-port", "-1"]).start()
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


async def generate(stub, prompt, params: SamplingParams) -> list[int]:
    req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompt),
                                  params=params_to_proto(params))
    return [t async for chunk in stub.Generate(req) for t in chunk.token_ids]


def test_greedy_equals_colocated_tp1(cluster, offline):
    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            stub = cluster.api(ch)
            got = await asyncio.gather(*(generate(stub, p, GREEDY) for p in PROMPTS))
            await cluster.wait_idle()
            return got

    assert asyncio.run(main()) == offline


def test_second_turn_pulls_only_its_new_blocks(cluster, tiny_models):
    """Decode-side prefix reuse across tensor-parallel sizes: a conversation's next turn keeps
    the blocks the decode worker cached (on every rank: one block pool allocates for all) and
    pulls only the rest, head by head; its greedy output equals the colocated engine's."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    first = PROMPTS[7]
    new = [(5 * j + 3) % 250 + 1 for j in range(20)]

    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            stub = cluster.api(ch)
            out1 = await generate(stub, first, params)
            second = first + out1 + new
            (decode,) = cluster.workers("decode")
            before = (await cluster.load(decode)).kv_blocks_pulled
            out2 = await generate(stub, second, params)
            pulled = (await cluster.load(decode)).kv_blocks_pulled - before
            await cluster.wait_idle()
            return second, out2, pulled, len(out1)

    second, out2, pulled, n1 = asyncio.run(main())
    kept = (len(first) + n1 - 1) // 16  # what turn 1 computed on the decode worker
    assert pulled == -(-len(second) // 16) - kept

    with LLM(str(tiny_models["qwen2"]), progress=False, num_blocks=128) as llm:
        (expected,) = llm.generate([second], params)
    assert out2 == expected.outputs[0].token_ids


def test_cancel_mid_stream_leaves_every_pool_idle(cluster):
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)

    async def main():
        async with grpc.aio.insecure_channel(cluster.router.address) as ch:
            stub = cluster.api(ch)
            calls = [stub.Generate(api_pb2.GenerateRequest(
                token_ids=api_pb2.TokenIds(ids=p), params=params_to_proto(params)))
                for p in PROMPTS[:4]]
            for i, call in enumerate(calls):
                for _ in range(1 if i % 2 else 4):  # during the handoff, or while decoding
                    await call.read()
                call.cancel()
            await cluster.wait_idle()

    asyncio.run(main())


@pytest.mark.parametrize("victim", ["worker", "rank 1"])
def test_decode_worker_or_its_rank_killed_mid_stream_frees_the_prefill_pool(
        tiny_qwen2_long, tmp_path, victim):
    """SIGKILL to a decode worker of two ranks (fed by a prefill worker of two ranks), or to its
    rank 1 alone: its requests fail UNAVAILABLE, its engine core and rank process are gone (a
    core without its rank exits, and the worker with it, exit code 1, for its supervisor to
    restart it), and every pool of the prefill worker is idle again."""
    c = Cluster(tmp_path, str(tiny_qwen2_long),
                worker_args=["--num-blocks", str(HOLD_BLOCKS), "--max-num-batched-tokens", "64",
                             "--cpu-threads", "1"],  # WORKER_ARGS with a pool for HOLD_TOKENS
                prefill_args=["--lease-ttl", "5", "--tensor-parallel-size", "2"],
                decode_args=["--tensor-parallel-size", "2"],
                router_args=["--http-port", "-1"]).start()
    try:
        params = SamplingParams(temperature=0, max_tokens=HOLD_TOKENS, ignore_eos=True)

        async def main():
            async with grpc.aio.insecure_channel(c.router.address) as ch:
                calls = await c.streams_under_way(ch, PROMPTS[:3], params)
                core = c.engine_core("decode0")
                ranks = children(core)
                assert len(ranks) == 1, ranks  # rank 1 (rank 0 is the core itself)
                if victim == "worker":
                    c.kill("decode0", signal.SIGKILL)
                else:
                    os.kill(ranks[0], signal.SIGKILL)
                for call in calls:
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        while (await call.read()) is not grpc.aio.EOF:
                            pass
                    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
                await c.wait_idle(procs=c.workers("prefill"))
                for pid in [core, *ranks]:
                    await wait_gone(pid)

        asyncio.run(main())
        if victim != "worker":
            assert c.procs["decode0"].popen.wait(30) == 1
    finally:
        c.stop()


def children(pid: int) -> list[int]:
    """Child processes of `pid` other than multiprocessing's resource tracker."""
    kids = [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [k for k in kids if b"resource_tracker" not in Path(f"/proc/{k}/cmdline").read_bytes()]


async def wait_gone(pid: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return
        if state == "Z":
            return
        assert time.monotonic() < deadline, f"process {pid} still alive"
        await asyncio.sleep(0.05)


def test_colocated_worker_at_tp2_equals_offline_tp1(tiny_models, tmp_path, offline):
    """`tandem worker --role both --tensor-parallel-size 2` behind the router."""
    c = Cluster(tmp_path, str(tiny_models["qwen2"]), prefill=0, decode=0, both=1,
                worker_args=[*WORKER_ARGS, "--tensor-parallel-size", "2"],
                router_args=["--http-port", "-1"]).start()
    try:
        async def main():
            async with grpc.aio.insecure_channel(c.router.address) as ch:
                stub = c.api(ch)
                got = await asyncio.gather(*(generate(stub, p, GREEDY) for p in PROMPTS))
                await c.wait_idle()
                return got

        assert asyncio.run(main()) == offline
    finally:
        codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes
