"""cost-placement on a 1P+1D CPU stack: a short prompt runs wholly on the decode worker (no
prefill worker admits it), a long one while the decode worker is busy is prefilled on the
prefill worker; every output equals the offline engine's, tandem:placements counts both, and
both pools end idle."""

from __future__ import annotations

import asyncio
import re

import grpc
import httpx

from cluster import WORKER_ARGS, Cluster
from tandem.engine.sampling_params import SamplingParams
from tandem.runtime.convert import params_to_proto
from tandem.v1 import api_pb2

# A long generation keeping the decode worker busy while the others are placed.
BUSY = ([(7 * j) % 250 + 1 for j in range(40)], SamplingParams(temperature=0, max_tokens=600,
                                                               ignore_eos=True))
SHORT = ([(11 * j) % 250 + 1 for j in range(12)], SamplingParams(temperature=0, max_tokens=16,
                                                                 ignore_eos=True))
LONG = ([(13 * j + 5) % 250 + 1 for j in range(150)],
        SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=16, ignore_eos=True))
ROUTER_ARGS = ["--routing-policy", "cost-placement", "--placement-short-prompt", "24",
               # The delay a 150-token prefill would add to the busy decode worker weighs 1000x
               # its own first token: it goes to the prefill worker, whatever the timings.
               "--placement-interference", "1000"]


async def generate(stub, prompt: list[int], params: SamplingParams,
                   first: asyncio.Event | None = None) -> list[list[int]]:
    req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompt),
                                  params=params_to_proto(params))
    tokens: dict[int, list[int]] = {i: [] for i in range(params.n)}
    async for chunk in stub.Generate(req):
        tokens[chunk.index] += chunk.token_ids
        if first is not None:
            first.set()
    return [tokens[i] for i in range(params.n)]


async def placements(c: Cluster) -> dict[tuple[str, str], float]:
    async with httpx.AsyncClient() as h:
        text = (await h.get(c.router.metrics_url)).text
    return {(p, r): float(v) for p, r, v in re.findall(
        r'^tandem:placements_total\{placement="([^"]+)",reason="([^"]+)"\} (\S+)$', text, re.M)}


def test_short_prompts_run_on_the_decode_worker_and_long_ones_disaggregated(
        tiny_models, tmp_path, offline):
    jobs = [BUSY, SHORT, LONG]
    expected = [[o.token_ids for o in out.outputs]
                for out in offline.generate([p for p, _ in jobs], [p for _, p in jobs])]
    c = Cluster(tmp_path, str(tiny_models["llama"]), worker_args=WORKER_ARGS,
                router_args=ROUTER_ARGS, metrics=True).start()
    try:
        async def main():
            async with grpc.aio.insecure_channel(c.router.address) as ch:
                stub = c.api(ch)
                (prefill,) = c.workers("prefill")
                busy_first = asyncio.Event()
                busy = asyncio.create_task(generate(stub, *BUSY, first=busy_first))
                await busy_first.wait()  # on the decode worker now, for 600 tokens
                before = (await c.load(prefill)).num_requests
                short = await generate(stub, *SHORT)
                after_short = (await c.load(prefill)).num_requests
                long = await generate(stub, *LONG)
                after_long = (await c.load(prefill)).num_requests
                outputs = [await busy, short, long]
                await c.wait_idle()
                return outputs, (before, after_short, after_long), await placements(c)

        outputs, admitted, placed = asyncio.run(main())
        assert outputs == expected
        before, after_short, after_long = admitted
        assert after_short == before  # the short prompt: prefilled by the decode worker
        assert after_long == before + 1  # the long one: by the prefill worker
        assert placed[("decode", "short")] == 1
        assert sum(v for (p, _), v in placed.items() if p == "disaggregated") >= 1
    finally:
        codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes
