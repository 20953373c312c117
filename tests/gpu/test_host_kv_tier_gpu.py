"""The host KV tier on a GPU: the copies on their side stream, pinned host memory and pipelined
steps. Conversations that outgrow a 24-block pool, float32, CUDA graphs and pipelined steps on:
outputs identical with and without the tier, fewer prompt tokens computed by exactly the
restored blocks; with an FP8 pool (bf16 model: a recomputed prefix may round differently, so
outputs are not compared) the same counts; pools idle.

Run on a CUDA box:  pytest -m gpu tests/gpu/test_host_kv_tier_gpu.py -v
"""

from __future__ import annotations

import pytest
import torch
from gpu_kernels import ON_GPU

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams

pytestmark = ON_GPU
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _run(model: str, host_gb: float, kv_cache_dtype: str) -> tuple[list, LLMEngine]:
    engine = LLMEngine(EngineConfig(model, device="cuda", dtype="float32" if kv_cache_dtype ==
                                    "auto" else "bfloat16", num_blocks=24, max_model_len=256,
                                    kv_cache_dtype=kv_cache_dtype, host_kv_cache_gb=host_gb),
                       progress=False)
    history = [[(7 * c + 3) % 500 + 1] for c in range(6)]
    outputs = []
    for t in range(4):
        for c in range(6):
            history[c] += [(31 * c + 17 * t + k) % 500 + 1 for k in range(20)]
            rid = f"c{c}t{t}"
            engine.add_request(rid, history[c], GREEDY)
            out = []
            while rid in engine.requests or engine.has_work():
                out += [tok for o in engine.step() if o.request_id == rid
                        for tok in o.new_token_ids]
            history[c] += out
            outputs.append(out)
    torch.cuda.synchronize()
    assert engine.is_idle()
    return outputs, engine


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_conversations_match_with_the_tier_on_cuda(tiny_models, kv_cache_dtype):
    if kv_cache_dtype == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 KV needs compute capability >= 8.9")
    model = str(tiny_models["llama"])
    want, plain = _run(model, 0, kv_cache_dtype)
    got, tiered = _run(model, 0.01, kv_cache_dtype)
    assert tiered.host_tier is not None and tiered.host_tier.memory.wait_ready(1) > 0
    assert tiered.host_tier.memory.chunks[0].is_pinned()
    if kv_cache_dtype == "auto":
        assert got == want
    hits = tiered.host_tier.stats().hits
    assert hits > 0
    assert (tiered.scheduler.num_prompt_tokens_computed
            == plain.scheduler.num_prompt_tokens_computed - 16 * hits)
