"""A step with prefill chunks as a mixed-step CUDA graph runs it (engine/cuda_graphs.py
MixedGraphRunner): static buffers padded to the token count, the decode kernel over every
sequence row and the prefill kernel over the chunks' work items. Here without the capture
(CPU, TRITON_INTERPRET=1): the same step run eagerly from the buffers gives the greedy tokens
the plain eager path gives, and the Triton backend's eager path (the prefill kernel's work
list) those of the torch backend. The captured graphs themselves: tests/gpu/test_mixed_graphs_gpu.py."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.engine import cuda_graphs
from tandem.engine.attention.triton_backend import TritonAttentionBackend
from tandem.engine.cuda_graphs import CudaGraphRunner, MixedGraphRunner, cheaper_sizes
from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams

PROMPTS = [[(31 * i + 7 * j) % 250 + 1 for j in range(3 + 29 * i)] for i in range(3)]
PARAMS = [SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True)
          for i in range(len(PROMPTS))]


def greedy(model: str, backend: str, prompts: list[list[int]] = PROMPTS,
           params: list[SamplingParams] = PARAMS) -> tuple[list[list[int]], int]:
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


@pytest.mark.parametrize("graph_rows", [16, 8])
def test_verify_steps_replay_decode_graphs(tiny_models, graph_rows):
    """Speculative decoding's verify steps (a decode carrying 1 + k tokens, engine/spec_decode/)
    whose only multi-token chunks are verify rows run as decode steps of 1 + k rows per
    verifying sequence (engine/model_runner.py _as_decode_rows): replayed from the decode
    CUDA graphs' buffers, not the mixed-step ones, they give the tokens of a run without
    speculation. Verify rows beside prompt chunks, or more rows than the decode graphs hold
    (graph_rows 8), stay mixed steps and give them too."""
    model = str(tiny_models["llama"])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(model, device="cpu", dtype="float32", progress=False, num_blocks=128)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    llm = LLM(model, device="cpu", dtype="float32", progress=False, num_blocks=128,
              max_num_batched_tokens=40, speculative_method="ngram",
              num_speculative_tokens=3)
    runner = llm.engine.runner
    runner.backend = TritonAttentionBackend(runner.pool, runner.num_heads,
                                            runner.config.head_dim ** -0.5)
    runner.prefill_block_q = runner.backend.prefill_block_q
    runner.graphs = CudaGraphRunner(runner.model, runner.backend, graph_rows, 64,
                                    torch.device("cpu"))
    runner.mixed_graphs = MixedGraphRunner(runner.model, runner.backend, 40, 512, 64,
                                           torch.device("cpu"))
    spec = llm.engine.spec
    spec.proposer = Answers({tuple(p): e for p, e in zip(PROMPTS, expected)})
    # Per step with verify rows: whether it has prompt chunks too, whether it should run as
    # decode rows, and (decode replays, mixed replays) in it.
    steps: list[tuple[bool, bool, tuple[int, int]]] = []
    execute = runner.execute

    def watched(batch, rows, row_token_index, *args, **kwargs):
        before = runner.graphs.replays, runner.mixed_graphs.replays
        out = execute(batch, rows, row_token_index, *args, **kwargs)
        if batch.num_verifies:
            chunks = any(n > 1 and not s.spec_token_ids
                         for s, n in zip(batch.seqs, batch.num_new_tokens))
            steps.append((chunks, not chunks and batch.num_tokens <= graph_rows,
                          (runner.graphs.replays - before[0],
                           runner.mixed_graphs.replays - before[1])))
        return out

    runner.execute = watched
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert llm.engine.is_idle()
    assert got == expected
    assert all(ran == ((1, 0) if as_decodes else (0, 1)) for _, as_decodes, ran in steps), steps
    assert sum(as_decodes for _, as_decodes, _ in steps) >= (3 if graph_rows == 16 else 1), steps
    if graph_rows == 8:  # verify-only steps too large for the decode graphs replayed mixed ones
        assert any(not chunks and not as_decodes for chunks, as_decodes, _ in steps), steps
    assert spec.counters.num_accepted_tokens > 0


class Answers:
    """Proposes each sequence's known continuation, its second draft token wrong: every
    verify step keeps some drafts and rejects others."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]]) -> None:
        self.answers = answers

    def propose(self, inp) -> list[list[int]]:
        out = []
        for seq, k in zip(inp.seqs, inp.max_tokens):
            n = seq.num_output_tokens
            draft = list(self.answers[tuple(seq.token_ids[:seq.num_prompt_tokens])][n:n + k])
            if len(draft) > 1:
                draft[1] = (draft[1] + 1) % 250
            out.append(draft)
        return out

    def release(self, seq) -> None:
        pass


@pytest.mark.parametrize("packed,remap", [(False, {}), (True, {}), (False, {1: 4, 2: 8, 4: 8})],
                         ids=["full-rows", "packed-rows", "larger-graphs"])
def test_pipelined_decode_steps_staged_into_the_graph_buffers_give_the_eager_tokens(
        tiny_models, monkeypatch, packed, remap):
    """Decode steps whose inputs go straight into the decode graphs' buffers
    (CudaGraphRunner.run_step: host lists staged into one of two buffers, the block table's
    rows as full rows in the same copy, or packed at the step's width and put in place on the
    device, as for rows too long to copy whole) give the eager path's tokens, as the batch
    shrinks from 3 rows (padded to a graph of 4) to 2 and 1 while requests of different
    lengths finish. The steps are pipelined: each step's token ids hold placeholders that the
    device fills from the step before (the fill's indices travel in the staged buffer), from
    the graph's own output buffer. (Steps that are not: the verify test above.) With sizes
    sent on to larger graphs (CudaGraphRunner.use_sizes, as when a larger one runs its
    projections faster), the batches run with more padding rows and give the same tokens."""
    if packed:
        monkeypatch.setattr(cuda_graphs, "DIRECT_TABLE_ENTRIES", 0)
    model = str(tiny_models["llama"])
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 7, 11)]
    plain = LLM(model, device="cpu", dtype="float32", progress=False, num_blocks=128)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    llm = LLM(model, device="cpu", dtype="float32", progress=False, num_blocks=128,
              async_scheduling=True)
    runner = llm.engine.runner
    runner.backend = TritonAttentionBackend(runner.pool, runner.num_heads,
                                            runner.config.head_dim ** -0.5)
    runner.prefill_block_q = runner.backend.prefill_block_q
    runner.graphs = CudaGraphRunner(runner.model, runner.backend, 8 if remap else 4, 64,
                                    torch.device("cpu"))
    assert runner.graphs.packed.numel() == (4 * 64 if packed else 0)
    runner.graphs.use_sizes(remap)
    fills, sizes = [], []
    run_step = runner.graphs.run_step
    forward = runner.graphs._forward

    def watched(*args):
        fills.append(bool(args[-1]))
        return run_step(*args)

    def sized(bs):
        sizes.append(bs)
        return forward(bs)

    runner.graphs._forward = sized
    runner.graphs.run_step = watched
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert llm.engine.is_idle()
    assert got == expected
    assert len(fills) >= 9  # decodes: 3 rows, then 2, then 1
    assert sum(fills) >= len(fills) - 1  # every decode step but the first is fed
    assert set(sizes) == ({4, 8} if remap else {1, 2, 4}), sizes
    runner.close()
    assert runner.graphs is None


def test_cheaper_sizes_send_a_size_on_only_to_a_clearly_faster_larger_one():
    """The decode graphs' sizes after their projections are timed (projection_times):
    a size goes to the cheapest larger one (the smallest of equals) only when that one is
    faster by more than the margin; never to a smaller one."""
    sizes = [8, 16, 24, 32, 40]
    ms = {8: 4.0, 16: 4.1, 24: 6.0, 32: 5.0, 40: 5.0}  # 24: a GEMM picked badly
    assert cheaper_sizes(sizes, ms, 0.05) == {24: 32}
    assert cheaper_sizes(sizes, ms, 0.2) == {}  # 5.0 is not under 0.8 * 6.0
    assert cheaper_sizes(sizes, {8: 9.0, 16: 5.0, 24: 4.0, 32: 6.0, 40: 4.0}, 0.05) == \
        {8: 24, 16: 24, 32: 40}
    assert cheaper_sizes(sizes, {s: 1.0 + s / 100 for s in sizes}, 0.05) == {}  # rising
    assert cheaper_sizes([8], {8: 1.0}) == {}


def test_pick_sizes_times_the_sizes_from_64_rows_and_sends_batches_on(tiny_models, monkeypatch):
    """CudaGraphRunner.pick_sizes (the timing itself needs CUDA graphs: here its figures are
    given): only sizes from MIN_TIMED_ROWS are timed, and every batch whose own graph a larger
    one beats by the margin replays that one; the others keep theirs."""
    llm = LLM(str(tiny_models["llama"]), device="cpu", dtype="float32", progress=False,
              num_blocks=64)
    runner = llm.engine.runner
    graphs = CudaGraphRunner(runner.model, runner.backend, 96, 64, torch.device("cpu"))
    timed = []

    def times(layer, sizes, dtype, device):
        timed.extend(sizes)
        return {s: 2.0 if s == 72 else 1.0 + s / 1000 for s in sizes}

    monkeypatch.setattr(cuda_graphs, "projection_times", times)
    graphs.pick_sizes(runner.model.model.layers[0], torch.float32)
    assert timed == [64, 72, 80, 88, 96]
    assert graphs.remap == {72: 80}
    assert [graphs.size_for[b] for b in (8, 64, 65, 72, 73, 96)] == [8, 64, 80, 80, 80, 96]
