"""A step with prefill chunks as a mixed-step CUDA graph runs it (engine/cuda_graphs.py
MixedGraphRunner): static buffers padded to the token count, the decode kernel over every
sequence row and the prefill kernel over the chunks' work items. Here without the capture
(CPU, TRITON_INTERPRET=1): the same step run eagerly from the buffers gives the greedy tokens
the plain eager path gives, and the Triton backend's eager path (the prefill kernel's work
list) those of the torch backend. The captured graphs themselves: tests/gpu/test_mixed_graphs_gpu.py."""

from __future__ import annotations

import torch

from engine.attention.triton_backend import TritonAttentionBackend
from engine.cuda_graphs import MixedGraphRunner
from engine.llm import LLM
from engine.sampling_params import SamplingParams

PROMPTS = [[(31 * i + 7 * j) % 250 + 1 for j in range(3 + 29 * i)] for i in range(3)]
PARAMS = [SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True)
          for i in range(len(PROMPTS))]


def greedy(model: str, backend: str) -> tuple[list[list[int]], int]:
    llm = LLM(model, device="cpu", dtype="float32", progress=False, num_blocks=128,
              max_num_batched_tokens=40)
    runner = llm.engine.runner
    if backend != "torch":
        runner.backend = TritonAttentionBackend(runner.pool, runner.num_heads,
                                                runner.config.head_dim ** -0.5)
        runner.prefill_block_q = runner.backend.prefill_block_q
    if backend == "mixed":
        runner.mixed_graphs = MixedGraphRunner(runner.model, runner.backend, 40, 512, 64,
                                               torch.device("cpu"))
    outs = llm.generate(PROMPTS, PARAMS)
    assert llm.engine.is_idle()
    replays = runner.mixed_graphs.replays if runner.mixed_graphs is not None else 0
    return [o.outputs[0].token_ids for o in outs], replays


def test_mixed_step_buffers_give_the_eager_tokens(tiny_models):
    model = str(tiny_models["llama"])
    expected, _ = greedy(model, "torch")
    assert greedy(model, "triton")[0] == expected
    got, replays = greedy(model, "mixed")
    assert replays > 0
    assert got == expected
