"""Start-up compiles every Triton kernel variant a step can launch (engine/warm_up.py): after an
engine starts, a workload of varied shapes (prompts of every length class, mixed steps, eager
and split decodes, preemption-free but batch sizes off the CUDA graph ladder) compiles nothing
more, so no request waits on a compile; with FP8 weights too (the weight-only matmul's M == 1
and M > 1 variants)."""

from __future__ import annotations

import gc
import random
from pathlib import Path

import pytest
import torch

from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LLAMA_1B = str(Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "llama-3.2-1b")


@pytest.mark.parametrize(("kv_cache_dtype", "quantization"),
                         [("auto", None), ("fp8", None), ("fp8", "fp8")],
                         ids=["bf16", "fp8-kv", "fp8-kv+w"])
def test_requests_compile_nothing_after_start_up(kv_cache_dtype, quantization):
    from tandem.kernels import compiled_variants

    if quantization and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 matmuls need compute capability >= 8.9")
    llm = LLM(LLAMA_1B, load_format="dummy", device="cuda", dtype="bfloat16",
              max_model_len=4096, max_num_seqs=64, max_num_batched_tokens=2048,
              kv_cache_dtype=kv_cache_dtype, quantization=quantization, progress=False)
    try:
        before = compiled_variants()
        rng = random.Random(0)
        # Lengths of every residue mod 16 and block count, short and long (split decodes),
        # more requests than max_num_seqs (eager decodes beside prefill chunks).
        lengths = [1, 2, 3, 15, 16, 17, 31, 33, 100, 255, 257, 1000, 1500, 2047, 3000, 3900]
        lengths += [rng.randrange(1, 3000) for _ in range(80)]
        prompts = [[rng.randrange(1, 30000) for _ in range(n)] for n in lengths]
        params = [SamplingParams(temperature=0, max_tokens=rng.choice([1, 2, 7, 40, 150]),
                                 ignore_eos=True) for _ in prompts]
        outs = llm.generate(prompts, params)
        assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
        after = compiled_variants()
        grown = {k: (before.get(k, 0), n) for k, n in after.items() if n != before.get(k, 0)}
        assert not grown, f"compiled during requests (before, after): {grown}"
        assert sum(before.values()) > 0
        assert llm.engine.is_idle()
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
