"""Steps with prefill chunks replayed from CUDA graphs (engine/cuda_graphs.py MixedGraphRunner)
give the tokens eager steps give: float32 greedy on the tiny checkpoints of every architecture,
a workload whose steps mix decodes with chunks of every length (a small token budget forces
chunking, the critical-path policy small paced chunks), with and without pipelined steps and
FP8 KV; the graphs did run, and every pool ends idle."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[(31 * i + 7 * j) % 250 + 1 for j in range(3 + 29 * i)] for i in range(14)]
PARAMS = [SamplingParams(temperature=0, max_tokens=8 + 9 * (i % 5), ignore_eos=True)
          for i in range(len(PROMPTS))]


def run(path, mixed: bool, **kwargs) -> tuple[list[list[int]], int]:
    """Greedy tokens, and how many steps replayed a mixed-step graph."""
    with LLM(str(path), device="cuda:0", dtype="float32", progress=False, num_blocks=256,
             max_num_batched_tokens=96, max_num_seqs=16, **kwargs) as llm:
        runner = llm.engine.runner
        if not mixed:
            runner.mixed_graphs = None
        outs = llm.generate(PROMPTS, PARAMS)
        assert llm.engine.is_idle()
        replays = runner.mixed_graphs.replays if runner.mixed_graphs is not None else 0
    return [o.outputs[0].token_ids for o in outs], replays


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_mixed_graphs_match_eager_steps(tiny_models, arch):
    expected, _ = run(tiny_models[arch], mixed=False)
    got, replays = run(tiny_models[arch], mixed=True)
    assert replays > 0
    assert got == expected


@pytest.mark.parametrize("kwargs", [
    {"scheduling_policy": "critical-path", "min_step_tokens": 24},
    {"async_scheduling": False},
    {"kv_cache_dtype": "fp8"},
], ids=["critical-path", "synchronous", "fp8-kv"])
def test_mixed_graphs_match_eager_steps_variants(tiny_models, kwargs):
    expected, _ = run(tiny_models["llama"], mixed=False, **kwargs)
    got, replays = run(tiny_models["llama"], mixed=True, **kwargs)
    assert replays > 0
    assert got == expected
