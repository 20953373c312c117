"""A process that answers a worker's GetLoad, and on its Stream call one token per request
(then nothing more), on 127.0.0.1: the router's liveness and failover tests stop it (SIGSTOP:
hung), resume it and kill it (gone) without an engine.

    python tests/fake_worker.py           # prints its port, then serves until killed
    python tests/fake_worker.py --finish  # the one token ends each request ("length")
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc

from tandem.v1 import worker_pb2, worker_pb2_grpc


class LoadOnly(worker_pb2_grpc.WorkerServicer):
    def __init__(self, finish: str = "") -> None:
        self.instance = uuid.uuid4().hex
        self.finish = finish  # the token's finish reason ("": the request goes on)

    async def GetLoad(self, request, context):  # noqa: N802 - gRPC method name
        return worker_pb2.Load(instance_id=self.instance, worker_id="fake", block_size=16)

    async def Stream(self, requests, context):  # noqa: N802
        async for req in requests:
            kind = req.WhichOneof("kind")
            if kind in ("decode", "generate"):
                rid = getattr(req, kind).request_id
                yield worker_pb2.StreamResponse(tokens=worker_pb2.TokenColumns(
                    request_id=[rid], sample_index=[0], num_tokens=[1], token_ids=[7],
                    finish_reason=[self.finish], num_prompt_tokens=[3], num_cached_tokens=[0],
                    with_logprobs=[False]))
                if self.finish:
                    yield worker_pb2.StreamResponse(
                        updates=[worker_pb2.RequestUpdate(request_id=rid, done=True)])


async def main() -> None:
    server = grpc.aio.server()
    finish = "length" if "--finish" in sys.argv[1:] else ""
    worker_pb2_grpc.add_WorkerServicer_to_server(LoadOnly(finish), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main())
