"""The critical-path policy across a prefill and a decode engine (engine/scheduler.py): the
prefill engine computes the prompt of the longest generation first and the rest shortest prompt
first, pacing nothing; the decode engine admits the pulled requests paced, so that its steps
carry about the work left over the longest request's remaining steps, the longest decoding
from the first step. The tokens are those of the same engines first-come first-served; every
pool ends idle."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import RemoteKV

DEVICE = os.environ.get("TANDEM_TEST_DEVICE", "cpu")
LENGTHS = [44, 12, 28, 36, 20, 52]  # prompt lengths, r0..r5
MAX_TOKENS = [6, 12, 6, 40, 6, 10]  # r3 is the longest generation
PROMPTS = [[(7 * i + j) % 60 + 3 for j in range(n)] for i, n in enumerate(LENGTHS)]
GREEDY = SamplingParams(temperature=0, ignore_eos=True)
KW = {"max_model_len": 256, "device": DEVICE, "max_num_batched_tokens": 16,
      "min_step_tokens": 1}


def _params(i: int) -> SamplingParams:
    return dataclasses.replace(GREEDY, max_tokens=MAX_TOKENS[i])


def _prefill(model: str, policy: str):
    """The prefill engine with every prompt handed off: (engine, handoffs in the order they
    came)."""
    eng = LLMEngine(EngineConfig(model, role="prefill", scheduling_policy=policy, **KW),
                    progress=False)
    eng.scheduler.waiting.max_wait_s = float("inf")  # no wait is overdue on a slow machine
    for i, prompt in enumerate(PROMPTS):
        eng.add_request(f"r{i}", prompt, _params(i))
    handoffs = []
    while eng.has_work():
        handoffs += [(o.request_id, o.handoff) for o in eng.step() if o.handoff is not None]
    return eng, handoffs


def _decode(model: str, policy: str, prefill, handoffs):
    """Tokens per request (the first from the prefill engine) and the requests that decoded
    in each step."""
    eng = LLMEngine(EngineConfig(model, role="decode", scheduling_policy=policy, **KW),
                    progress=False)
    eng.scheduler.waiting.max_wait_s = float("inf")

    def puller(remote, src, dst):
        eng.runner.pool[torch.tensor(dst, dtype=torch.long)] = \
            prefill.runner.pool[torch.tensor(src, dtype=torch.long)]

    eng.kv_connector.connect(puller)
    out = {}
    for rid, h in handoffs:
        i = int(rid[1:])
        eng.add_remote_request(rid, PROMPTS[i], _params(i), RemoteKV(
            "src", h.lease_id, float("inf"), h.block_ids, h.first_token_ids, h.first_logprobs))
        out[rid] = list(h.first_token_ids)
    steps = []
    while eng.has_work():
        decoded = set()
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
            if o.new_token_ids:
                decoded.add(o.request_id)
        steps.append(decoded)
    assert eng.is_idle() and eng.block_pool.is_idle()
    eng.shutdown()
    return out, [s for s in steps if s]


@pytest.fixture(scope="module")
def runs(tiny_models):
    model = str(tiny_models["llama"])
    got = {}
    for policy in ("fcfs", "critical-path"):
        prefill, handoffs = _prefill(model, policy)
        tokens, steps = _decode(model, policy, prefill, handoffs)
        for _, h in handoffs:
            assert prefill.kv_connector.release(h.lease_id)
        assert prefill.is_idle() and prefill.block_pool.is_idle()
        prefill.shutdown()
        got[policy] = ([rid for rid, _ in handoffs], tokens, steps)
    return got


def test_the_prefill_engine_computes_the_longest_generation_first(runs):
    assert runs["fcfs"][0] == ["r0", "r1", "r2", "r3", "r4", "r5"]
    # Chunks of 16 tokens. A prompt whose generation is the longest of those waiting or being
    # prefilled goes first (r3: 40 tokens; then r5: 10, the longest left once r3 and r1 are
    # done; then r0, the first of three 6-token generations, once r5 is done), the others
    # shortest prompt first in the budget left beside it (r1 beside r3, r4 beside r5; r2 last).
    assert runs["critical-path"][0] == ["r3", "r1", "r5", "r4", "r0", "r2"]


def test_the_decode_engine_paces_its_batch_along_the_longest_request(runs):
    _, _, fcfs = runs["fcfs"]
    _, _, paced = runs["critical-path"]
    assert len(fcfs[0]) == 6  # first come, first served: every request decodes at once
    # The work left is 39 + 11 + 9 + 4 x 5 decodes over r3's 39 steps: 2 a step. r3 decodes
    # in every step; the others take turns beside it; the run takes r3's steps, no more.
    assert "r3" in paced[0] and all("r3" in s for s in paced)
    assert max(len(s) for s in paced) == 2
    assert len(paced) == MAX_TOKENS[3] - 1


def test_tokens_are_those_of_first_come_first_served(runs):
    _, fcfs, _ = runs["fcfs"]
    _, paced, _ = runs["critical-path"]
    assert paced == fcfs
    assert all(len(paced[f"r{i}"]) == MAX_TOKENS[i] for i in range(6))
