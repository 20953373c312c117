"""The KV pool is sized after profiling the largest step, the largest sampled decode batch and
the CUDA graphs: large batch caps start and run on one card instead of running out of memory
while capturing graphs, and a setting that cannot fit fails at start naming a flag."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams
from tandem.errors import InvalidArgument

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LLAMA_8B = str(Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "llama-3.1-8b")


@pytest.mark.parametrize("max_num_seqs,max_tokens", [(1024, 8192), (512, 16384)])
def test_large_batch_caps_start_and_run_a_full_batch(max_num_seqs, max_tokens):
    llm = LLM(LLAMA_8B, load_format="dummy", device="cuda", dtype="bfloat16",
              max_model_len=2048, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
              progress=False)
    try:
        prompts = [[(7 * i + j) % 1000 + 1 for j in range(32)] for i in range(max_num_seqs)]
        params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, logprobs=5, max_tokens=4,
                                ignore_eos=True)
        outs = llm.generate(prompts, params)
        assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
        assert llm.engine.is_idle()
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def test_a_pool_that_cannot_hold_one_sequence_names_the_flag():
    with pytest.raises(InvalidArgument) as e:
        LLM(LLAMA_8B, load_format="dummy", device="cuda", dtype="bfloat16",
            max_model_len=131072, memory_fraction=0.001, progress=False)
    assert "--memory-fraction" in str(e.value)
    torch.cuda.empty_cache()
