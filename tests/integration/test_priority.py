"""`priority` end to end: a request parameter added through the seam of
engine/sampling_params.py. Over the real stack on the CPU (router, prefill and decode workers as
processes on 127.0.0.1), the decode worker holding one sequence at a time: a request sent later
with a lower priority value is admitted before an earlier one with the default, whether it came
over gRPC (tandem.client) or HTTP (the OpenAI extra field); a bad priority is refused naming
`params.priority` / `priority`."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from cluster import HOLD_TOKENS, HOLD_WORKER_ARGS, Cluster, serve
from tandem import client as tc

# Tokens: the sequence that holds the decode worker's one slot until cancelled (the others
# queue long before it could end; 1,000 steps once ended first under load).
LONG = HOLD_TOKENS


@pytest.fixture(scope="module")
def cluster(tiny_llama_long, tmp_path_factory):
    yield from serve(Cluster(tmp_path_factory.mktemp("priority"), str(tiny_llama_long),
                             worker_args=HOLD_WORKER_ARGS,
                             decode_args=["--max-num-seqs", "1"]))


@pytest.fixture(autouse=True)
def idle_after(cluster):
    yield
    asyncio.run(cluster.wait_idle())


async def _waiting(cluster: Cluster, count: int, holder: asyncio.Task, running: int = 0) -> None:
    """Until the decode worker has `count` requests waiting for its slot and `running` in it
    (while the holder still holds it)."""
    (decode,) = cluster.workers("decode")
    while (load := await cluster.load(decode)).num_waiting < count or \
            load.num_running < running:
        if holder.done():
            holder.result()  # its error, if it failed
            raise AssertionError("the long request ended before the others queued")
        await asyncio.sleep(0.02)


# The first token of each comes from the prefill worker at once; the others from the decode
# worker, one request at a time: the order requests finish in is the order it admitted them.
async def _finished(order: list[str], name: str, chunks) -> None:
    async with chunks:
        async for chunk in chunks:
            if chunk.finish_reason is not None:
                order.append(name)


async def _http_stream(base: str, priority: int | None, order: list[str], name: str) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "stream": True}
    if priority is not None:
        body["priority"] = priority
    async with httpx.AsyncClient(timeout=120) as http, \
            http.stream("POST", f"{base}/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"finish_reason":null' not in \
                    line.replace(" ", ""):
                order.append(name)


@pytest.mark.parametrize("surface", ["grpc", "http"])
def test_a_lower_priority_value_is_admitted_first(cluster, surface):
    base = f"http://127.0.0.1:{cluster.router.http_port}"

    async def main() -> list[str]:
        order: list[str] = []
        async with tc.AsyncClient(cluster.router.address, timeout=120) as client:
            holder_chunks = client.stream([1, 2, 3], max_tokens=LONG, ignore_eos=True)

            async def hold() -> None:
                async with holder_chunks as chunks:
                    async for _ in chunks:
                        pass

            holder = asyncio.create_task(hold())
            await _waiting(cluster, 0, holder, running=1)  # it holds the decode worker's slot
            earlier = asyncio.create_task(_finished(
                order, "earlier", client.stream([4, 5, 6], max_tokens=3, temperature=0, ignore_eos=True)))
            await _waiting(cluster, 1, holder)
            if surface == "grpc":
                later = asyncio.create_task(_finished(
                    order, "later", client.stream([7, 8, 9], max_tokens=3, temperature=0,
                                                  ignore_eos=True, priority=-1)))
            else:
                later = asyncio.create_task(_http_stream(base, -1, order, "later"))
            await _waiting(cluster, 2, holder)
            holder.cancel()  # the slot frees: the queue's order decides who goes next
            await asyncio.gather(earlier, later)
            return order

    assert asyncio.run(main()) == ["later", "earlier"]


def test_a_bad_priority_is_refused_naming_it(cluster):
    with tc.Client(cluster.router.address, timeout=60) as client, \
            pytest.raises(tc.InvalidArgumentError) as e:
        client.generate([1, 2, 3], max_tokens=2, priority=-2**31)
    assert (e.value.field, e.value.reason) == ("params.priority", "INVALID_VALUE")
    url = f"http://127.0.0.1:{cluster.router.http_port}/v1/completions"
    for bad in (2**31, "high", 1.5):
        r = httpx.post(url, json={"prompt": [1, 2], "max_tokens": 2, "priority": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", (bad, r.text)
