"""Role changes under load (`tandem up --elastic`'s mechanism, cli/supervisor.py): on a
supervised 1P+2D elastic stack with cluster TLS, a decode worker holding running streams is
changed to a prefill worker in place (SwitchRole: the same process and engine core, a new port
with its prefill certificate), then back to a decode worker by the restart path, while clients
keep sending. Its streams move to the other decode worker, no request fails, every output
equals the offline engine's, the router learns each new worker from the stack's workers file
and sends it work of its role, and every pool ends idle. The other decode worker, which pulled
the moved streams' KV from the changing worker's pool, later pulls prompts from the same pool
at the worker's new address (runtime/role_switch.py)."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest

from cluster import WORKER_ARGS, Cluster
from tandem.cli.supervisor import Supervisor
from tandem.engine.sampling_params import SamplingParams
from tandem.runtime.convert import params_to_proto
from tandem.v1 import api_pb2, worker_pb2, worker_pb2_grpc

# Streams long enough to be running on the converted worker when its drain starts, seconds
# after they start (test_faults.py's 320 tokens had ended within a second on a quiet machine).
LONG = SamplingParams(temperature=0, max_tokens=800, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG_PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(5 + 6 * i)] for i in range(4)]
LOAD_PROMPTS = [[(13 * i + 5 * j) % 250 + 1 for j in range(4 + 3 * i)] for i in range(6)]


async def generate(stub, prompt: list[int], params: SamplingParams) -> list[int]:
    req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompt),
                                  params=params_to_proto(params))
    return [t async for chunk in stub.Generate(req) for t in chunk.token_ids]


async def steady(stub, done: asyncio.Event, results: list, failures: list) -> None:
    """One client: short requests one after another until `done`."""
    i = 0
    while not done.is_set():
        prompt = LOAD_PROMPTS[i % len(LOAD_PROMPTS)]
        try:
            results.append((prompt, await generate(stub, prompt, SHORT)))
        except grpc.aio.AioRpcError as e:
            failures.append(f"{e.code().name}: {e.details()}")
        i += 1


async def holding_a_long_stream(c: Cluster) -> str:
    """Once a long stream runs (nothing else is sent yet), the decode worker running the most."""
    deadline = time.monotonic() + 60
    while True:
        running = {p.name: (await c.load(p)).num_running for p in c.workers("decode")}
        if any(running.values()):
            return max(running, key=running.__getitem__)
        assert time.monotonic() < deadline, "no long stream ever ran"
        await asyncio.sleep(0.05)


async def routed(h: httpx.AsyncClient, address: str, role: str) -> None:
    """Until the router's /workers lists `address` as an up worker of `role`."""
    deadline = time.monotonic() + 60
    while True:
        workers = (await h.get("/workers")).json()["workers"]
        if any(w["address"] == address and w["role"] == role and w["state"] == "up"
               and not w["draining"] for w in workers):
            return
        assert time.monotonic() < deadline, workers
        await asyncio.sleep(0.05)


async def serves(c: Cluster, stub, name: str, results: list, params: SamplingParams) -> None:
    """Until worker `name` took a request (fresh prompts sent meanwhile, outputs kept)."""
    deadline = time.monotonic() + 60
    k = 0
    while (await c.load(c.procs[name])).num_requests == 0:
        assert time.monotonic() < deadline, f"no request reached {name}"
        fresh = [[200 + k + j, 9, j + 1, 4] for j in range(4)]
        k += 4
        results.extend(zip(fresh, await asyncio.gather(
            *(generate(stub, p, params) for p in fresh)), strict=True))


def test_a_decode_worker_changes_role_in_place_and_back_by_restart_under_load(
        tiny_models, tmp_path, offline):
    c = Cluster(tmp_path, str(tiny_models["llama"]), prefill=1, decode=2,
                worker_args=WORKER_ARGS, cluster_ca=True, elastic=True).start()
    supervisor = Supervisor(c).start()
    try:
        async def main():
            async with grpc.aio.insecure_channel(c.router.address) as ch, \
                    httpx.AsyncClient(base_url=f"http://{c.router.address.split(':')[0]}:"
                                               f"{c.router.http_port}") as h:
                stub = c.api(ch)
                done = asyncio.Event()
                results: list = []
                failures: list = []
                longs = [asyncio.create_task(generate(stub, p, LONG)) for p in LONG_PROMPTS]
                name = await holding_a_long_stream(c)
                clients = [asyncio.create_task(steady(stub, done, results, failures))
                           for _ in range(2)]
                before = c.procs[name]
                pids = before.popen.pid, c.engine_core(name)
                supervisor.convert(name, "prefill", reason="test")
                (conv,) = await asyncio.to_thread(supervisor.wait_converted, 1, 300)
                # The router learns it from the workers file and sends it prompts.
                await routed(h, conv.address, "prefill")
                await serves(c, stub, conv.new_name, results, SHORT)
                new = c.procs[conv.new_name]
                in_place = (new.popen.pid, c.engine_core(conv.new_name)) == pids
                # Asked for what it cannot do, it refuses before draining anything.
                async with c.worker_channel(new) as wch:
                    with pytest.raises(grpc.aio.AioRpcError) as again:
                        await worker_pb2_grpc.WorkerStub(wch).SwitchRole(
                            worker_pb2.SwitchRoleRequest(role="prefill"), timeout=10)
                load = await c.load(new)  # over TLS: it holds a prefill certificate now
                with pytest.raises(grpc.aio.AioRpcError) as old_port:
                    await c.load(before)
                # Back to decode by a restart: the path a worker that cannot change in place
                # takes.
                supervisor.in_place = False
                supervisor.convert(conv.new_name, "decode", reason="test")
                (_, back) = await asyncio.to_thread(supervisor.wait_converted, 2, 300)
                await routed(h, back.address, "decode")
                await serves(c, stub, back.new_name, results, SHORT)
                restarted = c.procs[back.new_name].popen.pid not in pids
                done.set()
                await asyncio.gather(*clients)
                long_out = await asyncio.gather(*longs)
                await c.wait_idle(timeout=60)
                return (name, conv, back, in_place, load, old_port.value.code(), again.value,
                        restarted, results, failures, long_out)

        names = [p.name for p in c.workers()]
        other = dict(c.other_names)
        (name, conv, back, in_place, load, old_port, again, restarted, results, failures,
         long_out) = asyncio.run(main())
        assert conv.done and conv.failed is None, conv
        # In place: the same process and engine core, never exited, serving as prefill1 at
        # the address its SwitchRole answered; its old port closed.
        assert in_place and conv.exit_code is None and conv.switched_to == conv.address, conv
        assert conv.new_name == other[name] and load.role == "prefill" and not load.draining
        assert again.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "a prefill worker already" in again.details()
        assert old_port == grpc.StatusCode.UNAVAILABLE
        assert back.done and back.exit_code == 0 and restarted and back.new_name == name
        assert [p.name for p in c.workers()] == names  # its slot, its name in each role
        assert failures == []
        want = offline.generate(LONG_PROMPTS, LONG)
        assert long_out == [o.outputs[0].token_ids for o in want]
        distinct = {tuple(p): p for p, _ in results}
        ref = dict(zip(distinct, (o.outputs[0].token_ids for o in offline.generate(
            list(distinct.values()), SHORT)), strict=True))
        assert all(out == ref[tuple(p)] for p, out in results)
        assert len(results) > len(LOAD_PROMPTS)
        # Its streams moved to the other decode worker (and went on there, equal above).
        assert conv.moved >= 1 and conv.left == 0, conv
    finally:
        codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes
