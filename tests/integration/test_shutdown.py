"""SIGTERM to router, prefill and decode (separate processes) in the middle of a load: each
reports NOT_SERVING, refuses new requests (gRPC UNAVAILABLE, HTTP connection refused; workers
drain, answering polls with Load.draining) while its in-flight streams, gRPC and HTTP, run to
their last token (the only decode worker has nowhere to move them), then exits 0 well within
its grace."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster import Cluster
from tandem.engine.sampling_params import SamplingParams
from tandem.runtime.convert import params_to_proto
from tandem.v1 import api_pb2, worker_pb2, worker_pb2_grpc

GRACE_S = 20
WORKER_ARGS = ["--num-blocks", "256", "--max-num-batched-tokens", "64", "--grace", str(GRACE_S)]
MAX_TOKENS = 300
SERVING, NOT_SERVING = (health_pb2.HealthCheckResponse.SERVING,
                        health_pb2.HealthCheckResponse.NOT_SERVING)


def request(prompt: list[int], max_tokens: int = MAX_TOKENS) -> api_pb2.GenerateRequest:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompt),
                                   params=params_to_proto(params))


async def read_all(call, tokens: list[int]) -> str:
    reason = ""
    while (msg := await call.read()) is not grpc.aio.EOF:
        tokens += msg.token_ids
        reason = msg.finish_reason or reason
    return reason


def test_sigterm_drains_in_flight_refuses_new_and_exits_0(tiny_models, tmp_path):
    c = Cluster(tmp_path, str(tiny_models["llama"]), worker_args=WORKER_ARGS,
                router_args=["--grace", str(GRACE_S)]).start()
    prompts = [[(19 * i + 5 * j) % 480 + 1 for j in range(12 + 9 * i)] for i in range(4)]
    http_url = f"http://127.0.0.1:{c.router.http_port}"

    async def main():
        channels = {name: grpc.aio.insecure_channel(p.address) for name, p in c.procs.items()}
        http = httpx.AsyncClient(timeout=60)
        try:
            stub = c.api(channels["router"])
            calls = [stub.Generate(request(q)) for q in prompts]
            tokens: list[list[int]] = [[] for _ in calls]
            for call, got in zip(calls, tokens):
                for _ in range(2):  # past prefill: the decode worker is streaming it
                    got += (await call.read()).token_ids
            sse = await http.send(http.build_request(
                "POST", f"{http_url}/v1/completions",
                json={"prompt": prompts[0], "max_tokens": MAX_TOKENS, "temperature": 0,
                      "ignore_eos": True, "stream": True}), stream=True)
            events = sse.aiter_lines()
            first = await anext(events)
            assert first.startswith("data: ")
            watches = {name: health_pb2_grpc.HealthStub(ch).Watch(
                health_pb2.HealthCheckRequest(service="")) for name, ch in channels.items()}
            for w in watches.values():
                assert (await w.read()).status == SERVING

            t0 = time.monotonic()
            for name in c.procs:
                c.kill(name, signal.SIGTERM)
            for name, w in watches.items():
                assert (await w.read()).status == NOT_SERVING, name
                w.cancel()  # a watch is in flight too: leave so the drain need not wait for it
            await asyncio.sleep(0.3)

            # New requests are refused, on every service, while the old ones stream on.
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.api(channels["router"]).Generate(request(prompts[1], 4)).read()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            # Workers drain (docs/operations.md): they answer polls saying so while they
            # refuse new work; the only decode worker's streams have nowhere to move. Either
            # may have stopped already: the prefill worker once no prompt and no lease is
            # left, the decode worker once its streams reached their last token (a loaded
            # machine's client can be that slow); its router holds them meanwhile.
            for name in ("prefill0", "decode0"):
                try:
                    load = await worker_pb2_grpc.WorkerStub(channels[name]).GetLoad(
                        worker_pb2.GetLoadRequest(), timeout=5)
                except grpc.aio.AioRpcError as e:  # stopped already
                    assert e.code() == grpc.StatusCode.UNAVAILABLE, name
                else:
                    assert load.draining, name
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await worker_pb2_grpc.WorkerStub(channels["prefill0"]).Prefill(
                    worker_pb2.PrefillRequest(request_id="late", prompt_token_ids=[1, 2, 3],
                                              params=params_to_proto(SamplingParams())),
                    timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(httpx.ConnectError):
                await httpx.AsyncClient(timeout=5).post(f"{http_url}/v1/completions",
                                                        json={"prompt": [1, 2, 3],
                                                              "max_tokens": 2})
            # Every in-flight stream runs to its last token. The router may have exited by now
            # too (0, checked below), as the workers may: once it has sent every stream's last
            # token it is done, though this client has not read them yet (its transport holds
            # them); a router that left early would have cut a stream short here.
            reasons = [await read_all(call, got) for call, got in zip(calls, tokens)]
            assert reasons == ["length"] * len(calls)
            assert [len(t) for t in tokens] == [MAX_TOKENS] * len(calls)
            rest = [line async for line in events if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
            chunks = [json.loads(x.removeprefix("data: ")) for x in [first, *rest[:-1]]]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            return t0
        finally:
            await http.aclose()
            for ch in channels.values():
                await ch.close()

    try:
        t0 = asyncio.run(main())
        codes = {name: p.popen.wait(GRACE_S + 10) for name, p in c.procs.items()}
        assert codes == {"prefill0": 0, "decode0": 0, "router": 0}
        # Drained when the streams ended, not at the end of the grace period.
        assert time.monotonic() - t0 < GRACE_S - 5
    finally:
        c.stop()
    for p in c.procs.values():
        events = [line["event"] for line in p.json_logs()]
        assert any(e.startswith("shutting down") for e in events) and "drained" in events, \
            p.name


def test_a_draining_decode_worker_hands_back_the_lease_of_a_request_it_refuses(tiny_models,
                                                                              tmp_path):
    """A decode request that reaches a draining decode worker on a Stream call opened before
    is refused (UNAVAILABLE, saying it drains), and its prefill lease handed back unclaimed and
    unreleased (RequestUpdate.lease_returned): still valid at the prefill worker, for the router
    to send on to another decode worker or release. The request in flight runs to its end. The
    worker says it drains (StreamResponse.closing) and keeps the call open, even with nothing
    left running on it, until the router closes its side: a request sent meanwhile is read,
    never lost with a call the worker ended (gRPC's client then reported INTERNAL)."""
    # Leases outlive the test: a pool that comes back idle had its lease released.
    c = Cluster(tmp_path, str(tiny_models["llama"]), worker_args=WORKER_ARGS,
                prefill_args=["--lease-ttl", "600"]).start()
    p, d = c.workers("prefill")[0], c.workers("decode")[0]
    params = params_to_proto(SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                            ignore_eos=True))

    async def main():
        async with grpc.aio.insecure_channel(p.address) as pch, \
                grpc.aio.insecure_channel(d.address) as dch:
            async def handed_over(rid: str, prompt: list[int]) -> worker_pb2.StreamRequest:
                resp = await worker_pb2_grpc.WorkerStub(pch).Prefill(worker_pb2.PrefillRequest(
                    request_id=rid, prompt_token_ids=prompt, params=params))
                return worker_pb2.StreamRequest(decode=worker_pb2.DecodeRequest(
                    request_id=rid, prompt_token_ids=prompt, params=params, kv=resp.kv,
                    first_token_ids=resp.first_token_ids))

            outbox: asyncio.Queue = asyncio.Queue()

            async def sent():
                while (m := await outbox.get()) is not None:
                    yield m

            call = worker_pb2_grpc.WorkerStub(dch).Stream(sent())
            tokens = 0
            ends: dict[str, worker_pb2.RequestUpdate] = {}
            closing = False

            async def read_until(cond) -> None:
                nonlocal tokens, closing
                while not cond():
                    m = await call.read()
                    assert m is not grpc.aio.EOF, "the worker ended the call first"
                    tokens += len(m.tokens.token_ids)
                    ends.update({u.request_id: u for u in m.updates})
                    closing |= m.closing

            watch = health_pb2_grpc.HealthStub(dch).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == SERVING
            outbox.put_nowait(await handed_over("in-flight", [3, 1, 4, 1, 5, 9, 2, 6]))
            await read_until(lambda: tokens)  # decoding

            c.kill("decode0", signal.SIGTERM)
            assert (await watch.read()).status == NOT_SERVING
            # The worker drains and its only request has ended: nothing runs on the call.
            await read_until(lambda: closing and "in-flight" in ends
                             and ends["in-flight"].done)
            assert not ends["in-flight"].error_code
            assert tokens == MAX_TOKENS - 1  # the first came with the handoff
            late = await handed_over("late", [2, 7, 1, 8, 2, 8, 1, 8, 2, 8])
            assert (await c.load(p)).num_leases == 1
            outbox.put_nowait(late)
            await read_until(lambda: "late" in ends)
            assert ends["late"].error_code == grpc.StatusCode.UNAVAILABLE.value[0]
            assert "shutting down" in ends["late"].error_message
            assert ends["late"].draining and ends["late"].lease_returned
            outbox.put_nowait(None)  # closed on this side: the call ends
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
            assert (await c.load(p)).num_leases == 1  # neither claimed nor released
            released = await worker_pb2_grpc.WorkerStub(pch).Release(worker_pb2.ReleaseRequest(
                lease_id=late.decode.kv.lease_id, if_unclaimed=True))
            assert released.released
            await c.wait_idle(timeout=60, procs=[p])  # released: it expires after 600 s
            watch.cancel()

    try:
        asyncio.run(main())
        assert c.procs["decode0"].popen.wait(GRACE_S + 10) == 0
    finally:
        c.stop()
