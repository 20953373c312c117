"""Decode steps from the decode CUDA graphs' buffers (engine/cuda_graphs.py CudaGraphRunner),
without the capture (CPU, TRITON_INTERPRET=1), as test_mixed_steps.py runs the mixed-step
graphs'; and which graph a batch replays when a larger one runs its projections faster."""

from __future__ import annotations

import pytest
import torch
from graph_steps import PROMPTS, use_triton

from tandem.engine import cuda_graphs
from tandem.engine.cuda_graphs import CudaGraphRunner, cheaper_sizes
from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams


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
    use_triton(runner)
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
