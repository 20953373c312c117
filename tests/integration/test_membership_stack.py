"""A router that learns its workers from a file it re-reads (--workers-file): a decode worker
added to the file takes new requests without a router restart, and one removed from it drains:
its stream in flight runs to the end, it gets nothing new, and then the router lets it go.
Processes on 127.0.0.1 (shm transport)."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest
from test_disaggregated import PROMPTS, WORKER_ARGS, generate

from cluster import Cluster
from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams
from tandem.runtime.convert import params_to_proto
from tandem.v1 import api_pb2


def _write(path, lines: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{line}\n" for line in lines))
    os.replace(tmp, path)  # the router never reads half a file


async def _until_logged(proc, text: str, after: int = 0) -> None:
    """Until `text` appears in the process's JSON log events, past the first `after` ones."""
    while not any(text in e["event"] for e in proc.json_logs()[after:]):
        assert proc.popen.poll() is None, proc.log_text()[-3000:]
        await asyncio.sleep(0.05)


@pytest.mark.timeout(240)
def test_workers_file_adds_a_decode_worker_and_drains_the_removed_one(tiny_models, tmp_path):
    model = str(tiny_models["llama"])
    c = Cluster(tmp_path, model, prefill=0, decode=0)
    try:
        workers = {}
        for name, role in (("prefill0", "prefill"), ("decode0", "decode"), ("decode1", "decode")):
            workers[name] = c.spawn(name, ["worker", "--role", role, "--device", "cpu", "--model",
                                           model, "--port", "0", "--grace", "10",
                                           "--cpu-threads", "1", *WORKER_ARGS])
        c.wait_ready(list(workers.values()))
        p0, d0, d1 = workers["prefill0"], workers["decode0"], workers["decode1"]
        members = tmp_path / "workers"
        _write(members, ["# the stack", f"prefill {p0.address}", f"decode {d0.address}"])
        router = c.spawn("router", ["router", "--model", model, "--grace", "10",
                                    "--workers-file", str(members), "--membership-interval",
                                    "0.1", "--grpc-port", "0",
                                    "--http-port", "-1"])
        c.wait_ready([router])
        greedy = SamplingParams(temperature=0, max_tokens=10)
        expected = [o.outputs[0].token_ids for o in
                    LLM(model, progress=False, num_blocks=256).generate(PROMPTS[:4], greedy)]
        long = SamplingParams(temperature=0, max_tokens=600, ignore_eos=True)

        async def main():
            async with grpc.aio.insecure_channel(router.address) as ch:
                stub = c.api(ch)
                call = stub.Generate(api_pb2.GenerateRequest(
                    token_ids=api_pb2.TokenIds(ids=PROMPTS[7]), params=params_to_proto(long)))
                got: list[int] = []
                while len(got) < 3:  # the first token comes from prefill, the next ones from
                    got += (await call.read()).token_ids  # decode0: decoding there now
                assert (await c.load(d0)).num_requests == 1
                seen = len(router.json_logs())
                _write(members, [f"prefill {p0.address}", f"decode {d1.address}"])
                # Noticed within a few 0.1 s reads of the file; the stream has ~600 steps left.
                await _until_logged(router, f"worker {d0.address} (decode) left the membership: "
                                    "draining its 1 requests", seen)
                await _until_logged(router, f"worker {d1.address} (decode, ", seen)  # is up
                results = await asyncio.gather(*(generate(stub, p, greedy) for p in PROMPTS[:4]))
                assert [r[0][0] for r in results] == expected
                assert (await c.load(d0)).num_requests == 1  # nothing new went to decode0
                assert (await c.load(d1)).num_requests == 4
                reason = None
                while (chunk := await call.read()) is not grpc.aio.EOF:
                    got += chunk.token_ids
                    reason = chunk.finish_reason or reason
                assert len(got) == 600 and reason == "length"  # drained: it ran to the end
                await _until_logged(router, f"worker {d0.address} (decode) drained and removed",
                                    seen)
                await c.wait_idle()

        asyncio.run(main())
    finally:
        codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes
