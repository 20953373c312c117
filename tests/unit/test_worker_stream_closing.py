"""The router's side of a draining worker's Stream call (StreamResponse.closing): new requests
go on a new call, the old call carries only its own requests' cancels, and the router closes
its side of it once those requests have ended, so the worker, which never ends the call
first, reads everything sent on it. The router hears at once that the worker drains."""

from __future__ import annotations

import asyncio

import grpc

from tandem.router_svc.worker_stream import WorkerStream
from tandem.v1 import worker_pb2, worker_pb2_grpc


class DrainingWorker(worker_pb2_grpc.WorkerServicer):
    """Answers every request with one token; the first call also says the worker drains. Keeps
    what each call received, and sets `ended[i]` once call i's client closed its side."""

    def __init__(self) -> None:
        self.received: list[list[worker_pb2.StreamRequest]] = []
        self.ended: list[asyncio.Event] = []

    async def Stream(self, request_iterator, context):  # noqa: N802 - gRPC method name
        i = len(self.received)
        got: list[worker_pb2.StreamRequest] = []
        self.received.append(got)
        self.ended.append(asyncio.Event())
        async for msg in request_iterator:
            got.append(msg)
            if msg.WhichOneof("kind") == "generate":
                resp = worker_pb2.StreamResponse(closing=i == 0)
                cols = resp.tokens
                cols.request_id.append(msg.generate.request_id)
                cols.sample_index.append(0)
                cols.num_tokens.append(1)
                cols.token_ids.append(7)
                cols.finish_reason.append("")
                cols.num_prompt_tokens.append(3)
                cols.num_cached_tokens.append(0)
                cols.with_logprobs.append(False)
                yield resp
        self.ended[i].set()


def generate(rid: str) -> worker_pb2.StreamRequest:
    return worker_pb2.StreamRequest(generate=worker_pb2.GenerateOnWorkerRequest(
        request_id=rid, prompt_token_ids=[1, 2, 3]))


def test_a_closing_call_takes_no_new_request_and_is_closed_once_its_requests_end():
    async def main() -> None:
        worker = DrainingWorker()
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            address = f"127.0.0.1:{port}"
            async with grpc.aio.insecure_channel(address) as ch:
                ws = WorkerStream(worker_pb2_grpc.WorkerStub(ch), address)
                heard = asyncio.Event()
                ws.on_closing = heard.set  # the router's: no new request for this worker
                a = ws.request(generate("a"))
                assert (await anext(a)).samples[0].token_ids == [7]  # with closing
                await heard.wait()
                b = ws.request(generate("b"))
                assert (await anext(b)).samples[0].token_ids == [7]
                assert [m.generate.request_id for m in worker.received[1]] == ["b"]
                assert not worker.ended[0].is_set()  # "a" still runs on the first call
                await a.aclose()  # leaves before its end: cancelled there, then closed
                await worker.ended[0].wait()
                assert [m.WhichOneof("kind") for m in worker.received[0]] == \
                    ["generate", "cancel"]
                assert worker.received[0][1].cancel == "a"
                assert not worker.ended[1].is_set()  # the new call goes on
                await b.aclose()
                await ws.close()
        finally:
            await server.stop(None)

    asyncio.run(main())
