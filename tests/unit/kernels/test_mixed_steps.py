"""A step with prefill chunks as a mixed-step CUDA graph runs it (engine/cuda_graphs.py
MixedGraphRunner): static buffers padded to the token count, the decode kernel over every
sequence row and the prefill kernel over the chunks' work items. Here without the capture
(CPU, TRITON_INTERPRET=1): the same step run eagerly from the buffers gives the greedy tokens
the plain eager path gives, and the Triton backend's eager path (the prefill kernel's work
list) those of the torch backend. The captured graphs themselves: tests/gpu/test_mixed_graphs_gpu.py.
Decode steps from the decode graphs' buffers: test_decode_graph_steps.py and
test_verify_steps.py."""

from __future__ import annotations

import json

import torch
from graph_steps import PROMPTS, use_triton

from tandem.engine.cuda_graphs import MixedGraphRunner
from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams

PARAMS = [SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True)
          for i in range(len(PROMPTS))]


def greedy(model: str, backend: str, prompts: list[list[int]] = PROMPTS,
           params: list[SamplingParams] = PARAMS) -> tuple[list[list[int]], int]:
    llm = LLM(model, device="cpu", dtype="float32", progress=False, num_blocks=128,
              max_num_batched_tokens=40)
    runner = llm.engine.runner
    if backend != "torch":
        use_triton(runner)
    if backend == "mixed":
        runner.mixed_graphs = MixedGraphRunner(runner.model, runner.backend, 40, 512, 64,
                                               torch.device("cpu"))
    outs = llm.generate(prompts, params)
    assert llm.engine.is_idle()
    replays = runner.mixed_graphs.replays if runner.mixed_graphs is not None else 0
    runner.close()  # the graphs released, as before a tensor-parallel group is destroyed
    assert runner.mixed_graphs is None
    return [o.outputs[0].token_ids for o in outs], replays


def test_mixed_step_buffers_give_the_eager_tokens(tiny_models, monkeypatch):
    """Also: a mixed-step graph's decode launch runs the plan the model runner built over
    every sequence row the graph holds (kernels/paged_decode_launch.py decode_plan): one item
    per row, the decodes first, the rows without context after them, padded to the graph's
    capacity."""
    from tandem.engine.attention import triton_backend

    model = str(tiny_models["llama"])
    expected, _ = greedy(model, "torch")
    assert greedy(model, "triton")[0] == expected
    plans = []

    def recording(q, *args, **kwargs):
        if kwargs.get("plan") is not None:
            plans.append((q.shape[0], kwargs["plan"].clone()))
        return attend(q, *args, **kwargs)

    attend = triton_backend.paged_decode_attention
    monkeypatch.setattr(triton_backend, "paged_decode_attention", recording)
    got, replays = greedy(model, "mixed")
    assert replays > 0
    assert got == expected
    cfg = json.loads((tiny_models["llama"] / "config.json").read_text())
    rows = {r for r, _ in plans}
    assert len(plans) >= replays * cfg["num_hidden_layers"]  # a launch a layer a replay
    graph_plans = [(r, p) for r, p in plans if p.shape[0] > p[0, 1] + 1]  # padded: a graph's
    assert len(graph_plans) == replays * cfg["num_hidden_layers"], rows
    for r, plan in graph_plans:
        items = int(plan[0, 1])
        assert items == r  # tiny contexts: no sequence split
        assert sorted(plan[1:items + 1, 0].tolist()) == list(range(r))
        assert (plan[items + 1:, 0] == -1).all()


def test_planned_decodes_cut_long_contexts(tiny_models, monkeypatch):
    """Splits as short as one tile: the decodes beside a long context cut it into several work
    items, which the kernel merges. The greedy tokens are the torch backend's, eagerly and from
    the mixed-step graphs' buffers."""
    from tandem.engine.attention import triton_backend
    from tandem.kernels import paged_decode_launch

    monkeypatch.setattr(paged_decode_launch, "PLAN_MIN_SPLIT_TOKENS", 1)
    model = str(tiny_models["llama"])
    prompts = [PROMPTS[0], [(13 * j) % 250 + 1 for j in range(110)]]
    # The short one still decodes once the long prompt's chunks are done: decodes side by side.
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 4)]
    expected, _ = greedy(model, "torch", prompts, params)
    cut = []

    def recording(q, *args, **kwargs):
        plan = kwargs.get("plan")
        if plan is not None:
            items = plan[1:int(plan[0, 1]) + 1, 0].tolist()
            cut.append(len(items) > len(set(items)))  # a sequence in several items
        return attend(q, *args, **kwargs)

    attend = triton_backend.paged_decode_attention
    monkeypatch.setattr(triton_backend, "paged_decode_attention", recording)
    for backend in ("triton", "mixed"):
        cut.clear()
        assert greedy(model, backend, prompts, params)[0] == expected, backend
        assert any(cut), backend
