"""A prefill worker under the nixl transport killed and restarted on its address: the decode
worker drops the dead NIXL agent and reads the new one's pool. Processes on 127.0.0.1, UCX on
TCP over the loopback device. A module of its own: one stack at a time on the machine."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
from test_disaggregated import PROMPTS, WORKER_ARGS, generate
from test_disaggregated_nixl import UCX_LOOPBACK_TCP

from cluster import Cluster
from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams

try:
    import nixl._api  # noqa: F401
except ImportError as e:
    pytest.skip(f"the nixl package is not installed (pip install 'tandem[nixl]'): {e}",
                allow_module_level=True)


@pytest.mark.slow
def test_a_prefill_worker_killed_and_restarted_is_read_over_its_new_agent(tiny_models, tmp_path):
    """SIGKILL to the prefill worker (its NIXL agent dies with it), restarted on its address:
    the decode worker drops the dead agent, loads the new one's metadata, and outputs are the
    offline engine's again; every pool ends idle."""
    c = Cluster(tmp_path, str(tiny_models["llama"]), worker_args=WORKER_ARGS,
                prefill_args=["--lease-ttl", "3", "--transport", "nixl"],
                router_args=["--http-port", "0"],
                env=UCX_LOOPBACK_TCP).start()
    greedy = SamplingParams(temperature=0, max_tokens=8)
    offline = LLM(str(tiny_models["llama"]), progress=False, num_blocks=256)
    expected = [o.outputs[0].token_ids for o in offline.generate(PROMPTS[:4], greedy)]

    async def restarts() -> float:
        async with httpx.AsyncClient() as h:
            text = (await h.get(c.router.metrics_url)).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("tandem:worker_restarts_total"))

    async def outputs() -> list[list[int]]:
        async with grpc.aio.insecure_channel(c.router.address) as ch:
            stub = c.api(ch)
            return [r[0][0] for r in await asyncio.gather(*(generate(stub, p, greedy)
                                                             for p in PROMPTS[:4]))]

    try:
        assert asyncio.run(outputs()) == expected
        c.kill("prefill0")
        c.procs["prefill0"].popen.wait()
        c.wait_ready([c.restart("prefill0")])

        async def main():
            while await restarts() < 1:  # the router has seen the new instance answer
                await asyncio.sleep(0.05)
            assert await outputs() == expected
            await c.wait_idle()

        asyncio.run(main())
        mapped = [line["event"] for line in c.workers("decode")[0].json_logs()
                  if line["event"].startswith("mapped the KV pool")]
        assert len(mapped) == 2 and all("'transport': 'nixl'" in m for m in mapped)
    finally:
        codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes
