"""--kv-cache-dtype fp8 across processes on 127.0.0.1 (shm transport): the decode worker pulls
the prefill worker's FP8 pages unchanged and the stack's greedy output equals the offline
engine's with the same cache dtype; workers whose cache dtypes differ refuse to pair, naming
the flag."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cluster import Cluster
from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams
from tandem.runtime.convert import params_to_proto
from tandem.v1 import api_pb2, worker_pb2, worker_pb2_grpc

ENGINE_ARGS = ["--num-blocks", "128", "--max-num-batched-tokens", "64"]
PROMPTS = [[(11 * i + 5 * j) % 250 + 1 for j in range(6 + 13 * i)] for i in range(6)]


async def _generate(stub, prompt: list[int], params: SamplingParams) -> list[int]:
    req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompt),
                                  params=params_to_proto(params))
    return [t async for chunk in stub.Generate(req, timeout=60) for t in chunk.token_ids]


@pytest.fixture(scope="module")
def fp8_cluster(tiny_models, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("fp8"), str(tiny_models["llama"]),
                worker_args=[*ENGINE_ARGS, "--kv-cache-dtype", "fp8"],
                router_args=["--http-port", "-1"]).start()
    yield c
    codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes


def test_fp8_pages_handed_off_match_the_offline_engine(fp8_cluster, tiny_models):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    offline = LLM(str(tiny_models["llama"]), progress=False, num_blocks=128,
                  max_num_batched_tokens=64, kv_cache_dtype="fp8")
    expected = [o.outputs[0].token_ids for o in offline.generate(PROMPTS, params)]

    async def main():
        async with grpc.aio.insecure_channel(fp8_cluster.router.address) as ch:
            stub = fp8_cluster.api(ch)
            got = await asyncio.gather(*(_generate(stub, p, params) for p in PROMPTS))
        await fp8_cluster.wait_idle()
        return got

    assert asyncio.run(main()) == expected


def test_registration_with_another_cache_dtype_names_the_flag(fp8_cluster):
    p = fp8_cluster.workers("prefill")[0]

    async def main():
        async with grpc.aio.insecure_channel(p.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            layout = dict(block_size=16, num_layers=2, num_kv_heads=2, head_dim=64)
            ok = await stub.Register(worker_pb2.RegisterRequest(
                decode_worker_id="probe", layout=worker_pb2.PoolDescriptor(
                    dtype="float8_e4m3fn", **layout)))
            assert ok.pool.dtype == "float8_e4m3fn"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Register(worker_pb2.RegisterRequest(
                    decode_worker_id="probe", layout=worker_pb2.PoolDescriptor(
                        dtype="float32", **layout)))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "dtype" in e.value.details() and "--kv-cache-dtype" in e.value.details()

    asyncio.run(main())


def test_a_stack_with_mixed_cache_dtypes_fails_requests_naming_the_flag(tiny_models, tmp_path):
    """Prefill in fp8, decode in the model dtype: the decode worker's registration is refused,
    the request fails at once with the refusal, naming the flag, the prefill worker logs it,
    and both pools end idle."""
    c = Cluster(tmp_path, str(tiny_models["llama"]), worker_args=ENGINE_ARGS,
                prefill_args=["--kv-cache-dtype", "fp8"],
                router_args=["--http-port", "-1"]).start()
    try:
        async def main():
            async with grpc.aio.insecure_channel(c.router.address) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await _generate(c.api(ch), PROMPTS[1], SamplingParams(max_tokens=4))
            await c.wait_idle()
            return e.value

        err = asyncio.run(main())
        # The caller learns why, naming the flag (not just "no healthy decode worker").
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
        assert "--kv-cache-dtype" in err.details() and "dtype" in err.details(), err.details()
        log = c.workers("prefill")[0].log_text()
        assert "refused registration" in log and "--kv-cache-dtype" in log, log[-2000:]
    finally:
        codes = c.stop()
    assert all(code == 0 for code in codes.values()), codes
