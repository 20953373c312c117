"""The only prefill worker killed (kill -9) under load on a 1P+1D CPU stack: no request fails.
Prompts the router could not prefill go to the decode worker, which prefills them itself in
chunks; requests that had their first tokens but lost their lease before the decode worker
claimed it are replayed there (the prompt prefilled, the client's tokens recorded). Every
output equals the offline engine's (greedy and seeded, n = 1 and 2), the router stays ready,
tandem:prefill_fallbacks counts the requests that took the fallback, and the decode pool ends
idle."""

from __future__ import annotations

import asyncio
import re

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster import WORKER_ARGS, Cluster
from tandem.engine.sampling_params import SamplingParams
from tandem.runtime.convert import params_to_proto
from tandem.v1 import api_pb2

# Prompts up to 150 tokens: past the 64-token step budget, so a fallback prefill takes chunks.
PROMPTS = [[(17 * i + 3 * j) % 250 + 1 for j in range(5 + 13 * (i % 12))] for i in range(24)]
PARAMS = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
          SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, seed=4, max_tokens=24, ignore_eos=True)]
JOBS = [(p, PARAMS[i % len(PARAMS)]) for i, p in enumerate(PROMPTS)]
CLIENTS = 4  # requests in flight at once
KILL_AFTER = 5  # requests finished before the prefill worker is killed


async def generate(stub, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompt),
                                  params=params_to_proto(params))
    tokens: dict[int, list[int]] = {i: [] for i in range(params.n)}
    async for chunk in stub.Generate(req):
        tokens[chunk.index] += chunk.token_ids
    return [tokens[i] for i in range(params.n)]


async def fallbacks(c: Cluster) -> float:
    async with httpx.AsyncClient() as h:
        text = (await h.get(c.router.metrics_url)).text
    return sum(float(v) for v in re.findall(
        r"^tandem:prefill_fallbacks_total\{[^}]*\} (\S+)$", text, re.M))


def test_the_only_prefill_worker_killed_under_load_fails_no_request(tiny_models, tmp_path,
                                                                   offline):
    expected = [[o.token_ids for o in out.outputs]
                for out in offline.generate([p for p, _ in JOBS], [p for _, p in JOBS])]
    c = Cluster(tmp_path, str(tiny_models["llama"]), worker_args=WORKER_ARGS,
                prefill_args=["--lease-ttl", "5"], metrics=True).start()
    try:
        async def main():
            async with grpc.aio.insecure_channel(c.router.address) as ch:
                stub = c.api(ch)
                results: list[list[list[int]] | BaseException] = [[] for _ in JOBS]
                queue = list(range(len(JOBS)))
                finished = asyncio.Condition()
                done = 0

                async def client() -> None:
                    nonlocal done
                    while queue:
                        i = queue.pop(0)
                        try:
                            results[i] = await generate(stub, *JOBS[i])
                        except grpc.aio.AioRpcError as e:
                            results[i] = e
                        async with finished:
                            done += 1
                            finished.notify_all()

                clients = [asyncio.create_task(client()) for _ in range(CLIENTS)]
                async with finished:
                    await finished.wait_for(lambda: done >= KILL_AFTER)
                c.kill("prefill0")
                await asyncio.gather(*clients)
                ready = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service="readiness"))
                await c.wait_idle(procs=c.workers("decode"))
                return results, ready.status, await fallbacks(c)

        results, ready, taken = asyncio.run(main())
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        assert failed == []
        assert results == expected
        # Every request after the kill took the fallback (those still queued then at least).
        assert taken >= len(JOBS) - KILL_AFTER - CLIENTS
        assert ready == health_pb2.HealthCheckResponse.SERVING
    finally:
        codes = c.stop()
    assert codes["router"] == 0 and codes["decode0"] == 0, codes
