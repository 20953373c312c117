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


def test_a_prefix_lent_from_the_tier_reads_complete_on_another_stream(tiny_models):
    """Engine A's tier holds a conversation's turn 1 (its pool evicted it); A lends the prefix
    (copied back on the tier's side stream, pipelined steps on) and engine B reads the lent
    blocks on a stream of its own right after the lease is granted, as a NIXL READ would,
    outside A's streams: B computes only the rest, and its output equals an engine's without
    any tier. Pools idle once the lease is released."""
    from tandem.engine.sequence import RemoteKV

    model = str(tiny_models["llama"])

    def engine(host_gb: float) -> LLMEngine:
        return LLMEngine(EngineConfig(model, device="cuda", dtype="float32", num_blocks=24,
                                      max_model_len=256, host_kv_cache_gb=host_gb),
                         progress=False)

    def generate(e: LLMEngine, rid: str, prompt: list[int]) -> list[int]:
        e.add_request(rid, prompt, GREEDY)
        out = []
        while rid in e.requests or e.has_work():
            out += [t for o in e.step() if o.request_id == rid for t in o.new_token_ids]
        return out

    a = engine(0.01)
    first = [(11 * i + 5) % 500 + 1 for i in range(50)]
    prompt = [*first, *generate(a, "turn1", first), 7, 8, 9]
    for i in range(3):
        generate(a, f"fill{i}", [(13 * k + i) % 500 + 1 for k in range(120)])
    lent = a.lend_prefix(prompt)
    assert lent is not None and lent.num_tokens == 48
    b = engine(0)
    side = torch.cuda.Stream()
    pulled = []

    def pull(remote, src, dst):
        with torch.cuda.stream(side):
            b.runner.pool[torch.tensor(dst, device="cuda")] = \
                a.runner.pool[torch.tensor(src, device="cuda")]
        side.synchronize()
        pulled.extend(dst)

    b.kv_connector.connect(pull)
    b.add_remote_request("turn2", prompt, GREEDY, RemoteKV(
        "a", lent.lease_id, float("inf"), lent.block_ids, (), (), num_tokens=48, prefix=True))
    got = []
    while "turn2" in b.requests or b.has_work():
        got += [t for o in b.step() for t in o.new_token_ids]
    assert got == generate(engine(0), "ref", prompt)
    assert len(pulled) == 3 and b.scheduler.num_prompt_tokens_computed == len(prompt) - 48
    assert a.kv_connector.release(lent.lease_id)
    torch.cuda.synchronize()
    assert a.is_idle() and b.is_idle()
