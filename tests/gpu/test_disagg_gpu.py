"""Prefill on GPU 0 and decode on GPU 1, KV over CUDA IPC (and over NIXL, with the nixl extra):
output identical to the colocated engine on one GPU, and a bfloat16 Llama-3.1-8B-shaped model
serving a stream of requests."""

from __future__ import annotations

import asyncio
import importlib.util
import time
from pathlib import Path

import pytest
import torch

from cluster import Cluster
from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[(13 * i + 7 * j) % 250 + 1 for j in range(4 + 37 * i)] for i in range(16)]


def _cluster(tmp, model, worker_args, transport="cuda_ipc"):
    return Cluster(tmp, model, worker_args=worker_args,
                   prefill_args=["--device", "cuda:0", "--transport", transport],
                   decode_args=["--device", "cuda:1"], router_args=["--http-port", "-1"])


@pytest.mark.parametrize("transport", [
    "cuda_ipc",
    pytest.param("nixl", marks=pytest.mark.skipif(
        importlib.util.find_spec("nixl") is None, reason="the nixl package is not installed"))])
def test_cuda_ipc_matches_colocated(tiny_models, tmp_path, transport):
    """Over NIXL the decode worker polls its pulls between steps (pipelined steps go on)."""
    params = SamplingParams(temperature=0, max_tokens=32)
    llm = LLM(str(tiny_models["llama"]), device="cuda:0", dtype="float32", progress=False,
              num_blocks=512)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    del llm
    c = _cluster(tmp_path, str(tiny_models["llama"]),
                 ["--dtype", "float32", "--num-blocks", "512"], transport).start()
    try:
        got = c.generate(PROMPTS, params)
        asyncio.run(c.wait_idle())
    finally:
        codes = c.stop()
    assert got == expected
    assert all(code == 0 for code in codes.values()), codes


def test_8b_bf16_dummy_serves_a_stream(tmp_path):
    model = str(ROOT / "benchmarks" / "configs" / "llama-3.1-8b")
    c = _cluster(tmp_path, model, ["--load-format", "dummy", "--dtype", "bfloat16",
                                   "--max-model-len", "4096"]).start()
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, 128000, (int(n),), generator=g).tolist()
                   for n in torch.randint(64, 1024, (48,), generator=g)]
        params = SamplingParams(temperature=0.8, max_tokens=64, ignore_eos=True, seed=1)
        t0 = time.perf_counter()
        got = c.generate(prompts, params)
        dt = time.perf_counter() - t0
        asyncio.run(c.wait_idle())
        print(f"\n8B dummy bf16, P on GPU0 / D on GPU1: {len(prompts)} requests, "
              f"{sum(map(len, got))} tokens in {dt:.2f} s ({sum(map(len, got)) / dt:.0f} tok/s)")
    finally:
        codes = c.stop()
    assert all(len(t) == 64 for t in got)
    assert all(code == 0 for code in codes.values()), codes
