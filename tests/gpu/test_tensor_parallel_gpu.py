"""Tensor parallelism on two GPUs (NCCL): greedy tokens at TP 2 equal TP 1 in float32, with the
decode steps replayed from CUDA graphs that captured the all-reduces, and eagerly; the group is
left cleanly after graphs (several TP 2 engines in turn in this process); and a prefill worker at TP 2 feeding a decode worker at TP 1 over CUDA IPC, head by head."""

from __future__ import annotations

import asyncio

import pytest
import torch

from cluster import Cluster
from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.gpu2,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

PROMPTS = [[(13 * i + 7 * j) % 250 + 1 for j in range(4 + 37 * i)] for i in range(12)]
GREEDY = SamplingParams(temperature=0, max_tokens=32)


def greedy(path, **kwargs) -> tuple[list[list[int]], int]:
    """Greedy tokens of PROMPTS and how many decode steps replayed a CUDA graph."""
    with LLM(str(path), device="cuda:0", dtype="float32", progress=False, num_blocks=512,
             **kwargs) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert llm.engine.is_idle()
        graphs = llm.engine.runner.graphs
        replays = graphs.replays if graphs is not None else 0
    return [o.outputs[0].token_ids for o in outs], replays


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_tp2_equals_tp1_with_graphs(tiny_models, name):
    """TP 1 and TP 2 both replay CUDA graphs (TP 2's with its all-reduces captured)."""
    expected, replays_tp1 = greedy(tiny_models[name])
    got, replays_tp2 = greedy(tiny_models[name], tensor_parallel_size=2)
    assert replays_tp1 > 0 and replays_tp2 > 0
    assert got == expected


def test_tp2_eager_equals_tp1(tiny_models):
    expected, _ = greedy(tiny_models["llama"], cuda_graphs=False)
    got, replays = greedy(tiny_models["llama"], tensor_parallel_size=2, cuda_graphs=False)
    assert got == expected and replays == 0


@pytest.mark.parametrize(("p_tp", "d_tp", "d_device"), [("2", "1", "cuda:1"),
                                                         ("1", "2", "cuda:0")])
def test_heterogeneous_tp_over_cuda_ipc_equals_colocated(tiny_models, tmp_path, p_tp, d_tp,
                                                         d_device):
    """P TP 2 (cuda:0, cuda:1) → D TP 1 (cuda:1), and P TP 1 (cuda:1) → D TP 2 (cuda:0,
    cuda:1): workers share GPUs, so pools are fixed in size."""
    expected, _ = greedy(tiny_models["llama"])
    p_device = "cuda:0" if p_tp == "2" else "cuda:1"
    c = Cluster(tmp_path, str(tiny_models["llama"]),
                worker_args=["--dtype", "float32", "--num-blocks", "512"],
                prefill_args=["--device", p_device, "--transport", "cuda_ipc",
                              "--tensor-parallel-size", p_tp],
                decode_args=["--device", d_device, "--tensor-parallel-size", d_tp],
                router_args=["--http-port", "-1"]).start()
    try:
        got = c.generate(PROMPTS, GREEDY)
        asyncio.run(c.wait_idle())
    finally:
        codes = c.stop()
    assert got == expected
    assert all(code == 0 for code in codes.values()), codes
