"""Pipelined (asynchronous) scheduling, engine/async_step.py: the same tokens and finish
reasons as synchronous steps for every kind of request (many lengths at once, max_tokens,
stop tokens, EOS, stop strings, aborts with a step in flight, preemption, n > 1, grammars,
seeded top-k/top-p sampling, penalties and logprobs), prefix-cache blocks never hashed over a
placeholder, and every pool idle afterwards."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tandem.engine.sequence as sequence_module
from tandem.engine.async_step import PLACEHOLDER
from tandem.engine.llm import LLM
from tandem.engine.sampling_params import ResponseFormat, SamplingParams

# TANDEM_TEST_DEVICE=cuda runs the same comparisons on a GPU (CUDA graphs, pinned copies).
DEVICE = os.environ.get("TANDEM_TEST_DEVICE", "cpu")
PROMPTS = [[5 + i, 17, 33 + i, 2 * i + 1] * (2 + i) for i in range(8)]
PREFIX = [(7 * j) % 200 + 1 for j in range(40)]  # two full blocks and a half


def _make(tiny_models, **kw) -> dict[bool, LLM]:
    kw = {"max_model_len": 256, "device": DEVICE, **kw}
    return {a: LLM(str(tiny_models["llama"]), progress=False, max_n=4, async_scheduling=a,
                   **kw) for a in (True, False)}


@pytest.fixture(scope="module")
def llms(tiny_models):
    pair = _make(tiny_models)
    yield pair
    for llm in pair.values():
        assert llm.engine.is_idle()


@pytest.fixture(autouse=True)
def no_placeholder_hashed(monkeypatch):
    """Every prefix-cache hash in these tests is over known tokens."""
    real = sequence_module.hash_block

    def checked(parent, token_ids):
        assert PLACEHOLDER not in token_ids, "a block hashed with a placeholder in it"
        return real(parent, token_ids)

    monkeypatch.setattr(sequence_module, "hash_block", checked)


def result(outs) -> list:
    return [[(o.token_ids, o.finish_reason, o.text) for o in out.outputs] for out in outs]


def both(llms, prompts, params) -> list:
    """Runs both engines; asserts the same outputs and idle pools; returns them."""
    got = {a: result(llm.generate(prompts, params)) for a, llm in llms.items()}
    assert got[True] == got[False]
    for llm in llms.values():
        assert llm.engine.is_idle() and llm.engine.pipeline.inflight is None
    return got[True]


def test_many_lengths_at_once_greedy_and_pipelined(llms):
    params = [SamplingParams(temperature=0, max_tokens=3 + 5 * i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    steps = []
    eng = llms[True].engine
    eng.on_step = lambda outs: steps.append((eng.last_step, eng.pipeline.inflight is not None))
    try:
        out = both(llms, PROMPTS, params)
    finally:
        eng.on_step = None
    assert [len(o[0][0]) for o in out] == [3 + 5 * i for i in range(len(PROMPTS))]
    assert all(o[0][1] == "length" for o in out)
    # Steps really overlapped, and every sampled token was counted once.
    assert sum(1 for _, inflight in steps if inflight) > 10
    assert sum(s.num_sampled for s, _ in steps) == sum(3 + 5 * i for i in range(len(PROMPTS)))
    assert sum(s.num_prompt_tokens for s, _ in steps) == sum(map(len, PROMPTS))


def test_pipelined_steps_never_wait_in_the_sampler(llms, monkeypatch):
    """Plain requests sample through Sampler.sample (device tokens, no host copy); a request
    that needs its tokens on the host (logprobs) falls back to Sampler.__call__."""
    calls = {"call": 0, "sample": 0}
    sampler = type(llms[True].engine.runner.sampler)
    real_call, real_sample = sampler.__call__, sampler.sample

    def call(self, *a, **k):
        calls["call"] += 1
        return real_call(self, *a, **k)

    def sample(self, *a, **k):
        calls["sample"] += 1
        return real_sample(self, *a, **k)

    monkeypatch.setattr(sampler, "__call__", call)
    monkeypatch.setattr(sampler, "sample", sample)
    llms[True].generate(PROMPTS[:3], SamplingParams(temperature=0.7, top_p=0.9, seed=1,
                                                    max_tokens=10))
    assert calls["call"] == 0 and calls["sample"] == 10
    llms[True].generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, logprobs=1))
    assert calls["call"] == 4


def test_no_async_scheduling_flag():
    import argparse

    from tandem.runtime.engine_args import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    def flag(*args: str):
        return engine_config(p.parse_args(["--model", "m", *args])).async_scheduling

    assert flag() is None  # on CUDA, off on the CPU
    assert flag("--async-scheduling") is True
    assert flag("--no-async-scheduling") is False


def test_stop_token_ids_and_eos_stop_early(llms):
    base = both(llms, PROMPTS[:4], SamplingParams(temperature=0, max_tokens=20,
                                                  ignore_eos=True))
    stops = [toks[0][0][3] for toks in base]
    out = both(llms, PROMPTS[:4], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                  stop_token_ids=(s,)) for s in stops])
    for o, b, s in zip(out, base, stops):
        first = b[0][0].index(s)
        assert o[0][0] == b[0][0][:first + 1] and o[0][1] == "stop"
    # EOS: make a token the engines produce their end-of-sequence token.
    saved = {a: llm.engine.stops.eos_token_ids for a, llm in llms.items()}
    try:
        for llm in llms.values():
            llm.engine.stops.eos_token_ids = frozenset({stops[1]})
        out = both(llms, PROMPTS[:4], SamplingParams(temperature=0, max_tokens=20))
        assert out[1][0][1] == "stop"
    finally:
        for a, llm in llms.items():
            llm.engine.stops.eos_token_ids = saved[a]


def test_stop_strings(llms):
    base = both(llms, PROMPTS[2:6], SamplingParams(temperature=0, max_tokens=30,
                                                   ignore_eos=True))
    stops = []
    for b in base:
        text = b[0][2]
        cut = next(i for i in range(len(text) // 3, len(text)) if text[i:i + 2].isprintable())
        stops.append(text[cut:cut + 2])
    out = both(llms, PROMPTS[2:6], [SamplingParams(temperature=0, max_tokens=30,
                                                   ignore_eos=True, stop=[s]) for s in stops])
    for o, s in zip(out, stops):
        assert o[0][1] == "stop" and s not in o[0][2]


def test_abort_with_a_step_in_flight(llms):
    def run(llm: LLM) -> tuple[list[int], int]:
        eng = llm.engine
        p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        eng.add_request("keep", PROMPTS[1], p)
        eng.add_request("drop", PROMPTS[2], p)
        got: dict[str, list[int]] = {"keep": [], "drop": []}
        for _ in range(4):
            for o in eng.step():
                got[o.request_id] += o.new_token_ids
        in_flight = eng.pipeline.inflight is not None
        assert eng.abort("drop")
        while eng.has_work():
            for o in eng.step():
                got[o.request_id] += o.new_token_ids
        assert eng.is_idle()
        return got["keep"], len(got["drop"]), in_flight

    (a_keep, a_drop, in_flight), (s_keep, s_drop, _) = run(llms[True]), run(llms[False])
    assert in_flight
    assert a_keep == s_keep and len(a_keep) == 12
    assert a_drop == s_drop - 1  # the token of the step in flight is discarded


def test_preemption_same_tokens(tiny_models):
    tight = _make(tiny_models, num_blocks=12, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    both(tight, PROMPTS, params)
    assert all(llm.engine.scheduler.num_preemptions > 0 for llm in tight.values())


def test_max_model_len_ends_samples_in_flight(tiny_models):
    short = _make(tiny_models, max_model_len=48)
    # Each asks for all the context leaves (more is refused): they end in flight at 48.
    out = both(short, PROMPTS, [SamplingParams(temperature=0, max_tokens=48 - len(p),
                                               ignore_eos=True) for p in PROMPTS])
    assert [len(PROMPTS[i]) + len(o[0][0]) for i, o in enumerate(out)] == [48] * len(PROMPTS)


def test_n_samples_seeded_and_top_k_top_p(llms):
    params = [SamplingParams(n=3, temperature=1.0, seed=5 + i, max_tokens=15, ignore_eos=True)
              for i in range(3)]
    out = both(llms, PROMPTS[:3], params)
    assert len({tuple(t[0]) for t in out[0]}) > 1
    params = [SamplingParams(temperature=0.8, top_k=20 * i, top_p=1.0 - 0.05 * i, min_p=0.01 * i,
                             seed=11 * i, max_tokens=25) for i in range(len(PROMPTS))]
    both(llms, PROMPTS, params)


def test_grammars_pipelined_ending_with_a_step_in_flight(llms):
    """Grammar rows run pipelined (each such step takes the previous step's tokens between its
    forward pass and its sampling): valid JSON, the same tokens as synchronous steps, and
    samples whose grammar ends them (EOS) while the next step that holds them is in flight."""
    small = ResponseFormat("json_schema", json.dumps(
        {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["id"], "additionalProperties": False}))
    params = [SamplingParams(temperature=1.0, seed=10 + i, max_tokens=40, response_format=small)
              for i in range(4)]
    params += [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 2
    eng = llms[True].engine
    masked_in_flight = []
    eng.on_step = lambda outs: masked_in_flight.append(
        eng.pipeline.inflight is not None and any(s.grammar is not None for s in eng.pipeline.inflight.seqs))
    try:
        out = both(llms, PROMPTS[:6], params)
    finally:
        eng.on_step = None
    for o in out[:4]:
        assert json.loads(o[0][2])["id"] in range(10) and o[0][1] == "stop"
    assert sum(masked_in_flight) >= 4


def test_grammar_penalties_and_logprobs_fall_back(llms):
    fmt = ResponseFormat("json_schema", json.dumps(
        {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"],
         "additionalProperties": False}))
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    params = [plain, SamplingParams(temperature=1.0, seed=3, max_tokens=60, response_format=fmt),
              plain, SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3,
                                    presence_penalty=0.5),
              plain, SamplingParams(temperature=0, max_tokens=8, logprobs=2), plain]
    out = both(llms, PROMPTS[:7], params)
    json.loads(out[1][0][2])
    lps = llms[True].generate(PROMPTS[5:6], params[5])[0].outputs[0]
    assert [lp.sampled.token_id for lp in lps.logprobs] == lps.token_ids


def test_prefix_cache_hits_after_async_runs(llms):
    prompts = [[*PREFIX, 3 + i, 9 + i] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    first = both(llms, prompts[:1], params)
    # The prompt and its outputs (hashed as their tokens became known) are cached: a prompt
    # continuing the first one's output hits every full block of it.
    cont = [*prompts[0], *first[0][0][0][:20]]
    eng = llms[True].engine
    hits = eng.block_pool.prefix_hits
    outs = llms[True].generate([cont], params)
    assert outs[0].num_cached_tokens == (len(cont) - 1) // 16 * 16
    assert eng.block_pool.prefix_hits - hits == (len(cont) - 1) // 16
    assert result(outs) == result(llms[False].generate([cont], params))
    both(llms, prompts, params)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, len(PROMPTS) - 1), st.integers(1, 24),
                          st.sampled_from([0.0, 0.9]), st.integers(1, 2),
                          st.sampled_from([(), (7,), (100, 200)])),
                min_size=1, max_size=6))
def test_random_request_mixes(llms, mix):
    prompts = [PROMPTS[i] for i, *_ in mix]
    params = [SamplingParams(temperature=t, seed=i, n=n, max_tokens=m, stop_token_ids=s,
                             ignore_eos=True) for i, m, t, n, s in mix]
    both(llms, prompts, params)


def test_kv_pulls_in_stream_order_keep_steps_pipelined(tiny_models):
    """A decode engine whose pulls are ordered with its steps (`in_stream`, as over
    CUDA IPC) keeps pipelining while requests arrive and pull their KV: the same tokens as a
    synchronous decode engine, and pulls happen in steps launched with another in flight."""
    import torch
    from handoffs import prefill_all

    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sequence import RemoteKV

    model = str(tiny_models["llama"])
    kw = {"max_model_len": 256, "device": DEVICE}
    prefill = LLMEngine(EngineConfig(model, role="prefill", **kw), progress=False)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    handoffs = prefill_all(prefill, PROMPTS, params)

    def decode_all(pipelined: bool) -> tuple[dict[str, list[int]], int]:
        eng = LLMEngine(EngineConfig(model, role="decode", async_scheduling=pipelined, **kw),
                        progress=False)
        pulled = [0]

        def pull(remote, src, dst):
            pulled[0] += 1
            eng.runner.pool[torch.tensor(dst, dtype=torch.long)] = \
                prefill.runner.pool[torch.tensor(src, dtype=torch.long)]

        eng.kv_connector.connect(pull, in_stream=lambda kv: True)
        pulls_in_flight = [0]

        def on_step(_outs):
            if pulled[0] and eng.pipeline.inflight is not None:
                pulls_in_flight[0] += pulled[0]
            pulled[0] = 0

        eng.on_step = on_step
        out: dict[str, list[int]] = {}
        pending = list(enumerate(PROMPTS))
        while pending or eng.has_work():
            for i, prompt in pending[:2]:  # two arrivals a step, beside running decodes
                h = handoffs[f"r{i}"]
                eng.add_remote_request(f"r{i}", prompt, params, RemoteKV(
                    "src", "L", float("inf"), h.block_ids, h.first_token_ids, h.first_logprobs))
                out[f"r{i}"] = list(h.first_token_ids)
            pending = pending[2:]
            for o in eng.step():
                out[o.request_id] += o.new_token_ids
        assert eng.is_idle()
        eng.shutdown()
        return out, pulls_in_flight[0]

    (a, overlapped), (s, _) = decode_all(True), decode_all(False)
    assert a == s and all(len(t) == 24 for t in a.values())
    assert overlapped >= 4
    for h in handoffs.values():
        assert prefill.kv_connector.release(h.lease_id)
    assert prefill.is_idle()
    prefill.shutdown()
