"""Prompt logprobs (engine/prompt_logprobs.py) against transformers' own forward pass of the
same checkpoint: each prompt token's log-probability given the tokens before it, and the top N
there, whether the prompt is prefilled in one step or in chunks, beside requests that ask for
none, with n > 1, and a second time when its blocks are in the prefix cache."""

from __future__ import annotations

import pytest
import torch
import transformers

from tandem.engine import prompt_logprobs
from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import Sequence

PROMPT = [(37 * i) % 500 + 3 for i in range(45)]
OTHER = [(11 * i) % 500 + 3 for i in range(30)]


@pytest.fixture(scope="module")
def reference(tiny_models) -> torch.Tensor:
    """log_softmax of transformers' logits at each position of PROMPT."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_models["llama"],
                                                              torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _check(got, ref: torch.Tensor, k: int) -> None:
    assert len(got) == len(PROMPT) - 1
    for p, lp in enumerate(got):  # position p predicts PROMPT[p + 1]
        assert lp.sampled.token_id == PROMPT[p + 1]
        assert lp.sampled.logprob == pytest.approx(ref[p, PROMPT[p + 1]].item(), abs=2e-3)
        top = ref[p].topk(k)
        assert [t.token_id for t in lp.top] == top.indices.tolist()
        assert [t.logprob for t in lp.top] == pytest.approx(top.values.tolist(), abs=2e-3)


@pytest.mark.parametrize("chunk", [512, 16])
def test_prompt_logprobs_are_the_models_own(tiny_models, reference, chunk):
    llm = LLM(str(tiny_models["llama"]), device="cpu", dtype="float32", progress=False,
              num_blocks=128, block_size=16, max_num_batched_tokens=chunk)
    try:
        want = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
        outs = llm.generate([PROMPT, OTHER, PROMPT],
                            [want, SamplingParams(max_tokens=2, temperature=0),
                             SamplingParams(max_tokens=2, n=2, prompt_logprobs=3)])
        _check(outs[0].prompt_logprobs, reference, 3)
        assert outs[1].prompt_logprobs is None
        _check(outs[2].prompt_logprobs, reference, 3)
        # Again, with PROMPT's blocks cached: every position is computed all the same.
        again = llm.generate([PROMPT], want)[0]
        _check(again.prompt_logprobs, reference, 3)
        assert again.num_cached_tokens == 0
        assert llm.engine.is_idle()
    finally:
        llm.shutdown()


def test_a_sequence_is_held_back_from_pipelining_only_while_its_prompt_is_computed(
        tiny_models):
    """A step needing a prompt's logits on the host is not pipelined; once the prompt is
    computed (or on a decode worker, whose prompt KV was pulled) the sequence no longer holds
    its batch back."""
    llm = LLM(str(tiny_models["llama"]), device="cpu", dtype="float32", progress=False,
              num_blocks=64, block_size=16, max_num_batched_tokens=16)
    try:
        llm.engine.add_request("r", PROMPT, SamplingParams(max_tokens=4, prompt_logprobs=0))
        (seq,) = llm.engine.requests["r"]
        assert prompt_logprobs.pending(seq)
        while not llm.engine.is_idle():
            llm.engine.step()
            if seq.num_computed_tokens >= len(PROMPT):
                assert not prompt_logprobs.pending(seq)
        assert len(seq.prompt_logprobs) == len(PROMPT) - 1
    finally:
        llm.shutdown()
    pulled = Sequence("d", PROMPT, SamplingParams(max_tokens=4, prompt_logprobs=0))
    pulled.num_computed_tokens = len(PROMPT)  # as a decode worker's, its prompt KV pulled
    assert not prompt_logprobs.pending(pulled)
