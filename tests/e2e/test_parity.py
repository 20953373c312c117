"""Greedy parity with transformers: the engine's tokens equal `generate(do_sample=False)` for
tiny random checkpoints of every supported architecture, in float32 on the CPU (or on CUDA
with the Triton backend when the GPU run selects it)."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams
from tiny import ARCHS

DEVICE = os.environ.get("TANDEM_TEST_DEVICE", "cpu")
NEW_TOKENS = 32
# 8 prompts of different lengths (3 .. 45 tokens), token ids inside every tiny vocabulary.
PROMPTS = [[1 + (7 * i + 3 * j) % 250 for j in range(3 + 6 * i)] for i in range(8)]
# Prompts sharing a 40-token prefix (2.5 blocks of 16), for the prefix cache.
PREFIX = [(11 * j) % 250 + 1 for j in range(40)]
SHARED = [PREFIX + [200 + i] * (1 + i) for i in range(8)]


@pytest.fixture(scope="module")
def hf_model(tiny_models):
    """name -> transformers' model of that tiny checkpoint (float32, loaded once)."""
    models: dict[str, torch.nn.Module] = {}

    def model(name: str) -> torch.nn.Module:
        if name not in models:
            models[name] = transformers.AutoModelForCausalLM.from_pretrained(
                tiny_models[name], dtype=torch.float32).eval()
        return models[name]

    return model


@pytest.fixture(scope="module")
def hf_reference(hf_model):
    """name -> function(prompts) -> transformers' greedy tokens, memoised per prompt."""
    cache: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def reference(name: str, prompts: list[list[int]]) -> list[list[int]]:
        out = []
        for p in prompts:
            key = (name, tuple(p))
            if key not in cache:
                with torch.no_grad():
                    ids = hf_model(name).generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS,
                                                  do_sample=False)
                cache[key] = ids[0, len(p):].tolist()
            out.append(cache[key])
        return out

    return reference


def run_engine(path, prompts, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), device=DEVICE, progress=False, **kwargs)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    assert llm.engine.is_idle(), "KV pool not back to idle after generate"
    return [o.outputs[0].token_ids for o in outs], llm


ARCH_NAMES = list(ARCHS)  # every tiny checkpoint: one per architecture (and rotary scaling)


@pytest.mark.parametrize("name", ARCH_NAMES)
def test_greedy_matches_transformers(tiny_models, hf_reference, name):
    got, _ = run_engine(tiny_models[name], PROMPTS)
    assert got == hf_reference(name, PROMPTS)


@pytest.mark.parametrize("name", ARCH_NAMES)
def test_logprobs_match_transformers(tiny_models, hf_model, name):
    """Each sampled token's log-probability is transformers' log-softmax of its logits: what
    greedy tokens cannot show (a scale on the logits, as Granite's logits_scaling)."""
    llm = LLM(str(tiny_models[name]), device=DEVICE, progress=False)
    outs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=8, logprobs=0))
    for prompt, out in zip(PROMPTS[:3], outs):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            logits = hf_model(name)(torch.tensor([prompt + tokens])).logits[0].float()
        want = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
        want = want.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        got = torch.tensor([lp.sampled.logprob for lp in out.outputs[0].logprobs])
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_greedy_with_small_chunks(tiny_models, hf_reference, name):
    got, _ = run_engine(tiny_models[name], PROMPTS, max_num_batched_tokens=16)
    assert got == hf_reference(name, PROMPTS)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_greedy_with_prefix_cache_hits(tiny_models, hf_reference, name):
    llm = LLM(str(tiny_models[name]), device=DEVICE, progress=False, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    # The first request fills the cache; the rest reuse its two full prefix blocks.
    first = llm.generate([SHARED[0]], params)
    rest = llm.generate(SHARED[1:], params)
    got = [o.outputs[0].token_ids for o in first + rest]
    assert got == hf_reference(name, SHARED)
    assert all(o.num_cached_tokens == 32 for o in rest)
    assert llm.engine.is_idle()


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_greedy_under_preemption(tiny_models, hf_reference, name):
    # 12 blocks of 16 tokens cannot hold 8 sequences of up to 77 tokens: some are preempted
    # and recomputed, and the output must not change.
    got, llm = run_engine(tiny_models[name], PROMPTS, num_blocks=12)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == hf_reference(name, PROMPTS)
