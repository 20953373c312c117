"""Speculative decoding's verify steps from the decode CUDA graphs' buffers, without the
capture (CPU, TRITON_INTERPRET=1), as test_mixed_steps.py runs the mixed-step graphs'."""

from __future__ import annotations

import pytest
import torch
from graph_steps import PROMPTS, use_triton

from tandem.engine.cuda_graphs import CudaGraphRunner, MixedGraphRunner
from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams


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
    use_triton(runner)
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
