"""A request id a caller chooses is its tenant's: while tenant A's request "shared" is in flight,
tenant B's request "shared" is served (B neither learns that A's id is live nor takes it), and
A reusing its own live id is refused. The public gRPC API with API keys on 127.0.0.1, over the
real Frontend and Orchestrator; the workers' leg is a stand-in held by an event."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem.engine.sampling_params import SamplingParams
from tandem.router_svc.frontend import Frontend, ModelInfo
from tandem.router_svc.grpc_api import TandemServicer
from tandem.router_svc.orchestrator import Orchestrator
from tandem.router_svc.worker_stream import SampleUpdate, Update
from tandem.router_svc.workers import WorkerSet
from tandem.runtime.convert import params_to_proto
from tandem.runtime.lifecycle import make_server
from tandem.runtime.security import ApiKeyInterceptor, ApiKeys, bind
from tandem.v1 import api_pb2, api_pb2_grpc

KEYS = ("key-of-tenant-a", "key-of-tenant-b")
HELD = [1]  # a prompt whose request stays in flight until released


class HeldLegs(Orchestrator):
    """The Orchestrator's own request-id bookkeeping (run) over a stand-in colocated leg."""

    def __init__(self) -> None:
        super().__init__(WorkerSet([], [], []))
        self.release = asyncio.Event()
        self.held = asyncio.Event()
        self.ids: list[str] = []  # as the workers would see them

    async def _colocated(self, rid, route, *_):  # params, deadline, trace context, ...
        self.ids.append(rid)
        prompt = route.prompt
        if prompt == HELD:
            self.held.set()
            await self.release.wait()
        yield Update([SampleUpdate(0, [7], [None], "length")], len(prompt), 0)


def generate(prompt: list[int], request_id: str) -> api_pb2.GenerateRequest:
    return api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompt), request_id=request_id,
                                   params=params_to_proto(SamplingParams(max_tokens=1)))


def test_request_ids_are_scoped_per_tenant():
    async def main():
        legs = HeldLegs()
        fe = Frontend(None, legs, ModelInfo("m", "llama", 64, 512, "float32", 16))
        server = make_server([ApiKeyInterceptor(ApiKeys(list(KEYS)))])
        port = bind(server, "127.0.0.1", 0)
        api_pb2_grpc.add_TandemServicer_to_server(TandemServicer(fe), server)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = api_pb2_grpc.TandemStub(ch)

                def call(prompt: list[int], key: str):
                    return stub.Generate(generate(prompt, "shared"), timeout=60,
                                         metadata=(("authorization", f"Bearer {key}"),))

                a = call(HELD, KEYS[0])
                await asyncio.wait_for(legs.held.wait(), 60)  # A's "shared" is in flight
                b = [c async for c in call([2], KEYS[1])]
                with pytest.raises(grpc.aio.AioRpcError) as again:
                    [c async for c in call([3], KEYS[0])]
                legs.release.set()
                a_chunks = [c async for c in a]
        finally:
            await server.stop(None)
        return legs.ids, a_chunks, b, again.value

    ids, a, b, again = asyncio.run(main())
    # B is served under its own id, and sees its own id; A's request runs to its end.
    assert [(c.request_id, list(c.token_ids)) for c in b] == [("shared", [7])]
    assert [(c.request_id, list(c.token_ids)) for c in a] == [("shared", [7])]
    # A's second "shared" while the first is live: refused, naming the field.
    assert again.code() == grpc.StatusCode.INVALID_ARGUMENT and "in use" in again.details()
    # Inside the cluster the two tenants' "shared" are different ids (the refused one never
    # reached a leg), neither carrying a key.
    assert len(ids) == 2 and len(set(ids)) == 2
    assert all(i.startswith("shared.") and len(i) <= 128 for i in ids)
    assert not any(k in i for k in KEYS for i in ids)


def test_without_keys_an_id_is_the_callers_as_given():
    assert Frontend.scoped_request_id("mine", "") == "mine"
    long = Frontend.scoped_request_id("x" * 128, "tenant")
    assert len(long) == 128 and long != Frontend.scoped_request_id("x" * 127 + "y", "tenant")
