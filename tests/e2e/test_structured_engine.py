"""Grammar-constrained decoding in the engine: outputs of a random model valid against their
schema with n > 1, through preemption (recompute) and prefix-cache hits, the same tokens as a
run with room to spare; min_tokens and logit_bias; grammars compiled once per schema."""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest

from tandem.engine.llm import LLM
from tandem.engine.sampling_params import ResponseFormat, SamplingParams
from tandem.errors import InvalidArgument

SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]},
                                  "maxItems": 3},
                         "note": {"type": "string", "maxLength": 5}},
          "required": ["id", "tags", "note"], "additionalProperties": False}
FMT = ResponseFormat("json_schema", json.dumps(SCHEMA))
# A shared 48-token prefix (three full blocks) so later prompts hit the prefix cache.
PREFIX = [(7 * j) % 200 + 1 for j in range(48)]
PROMPTS = [[*PREFIX, 10 + i, 20 + i] for i in range(6)]


def _params(i: int) -> SamplingParams:
    return SamplingParams(n=3, temperature=1.0, seed=100 + i, max_tokens=120,
                          response_format=FMT)


def _run(llm: LLM) -> list[list[list[int]]]:
    # The first prompt alone, so the others find PREFIX in the prefix cache.
    outs = [*llm.generate(PROMPTS[:1], _params(0)),
            *llm.generate(PROMPTS[1:], [_params(i) for i in range(1, len(PROMPTS))])]
    for out in outs:
        for o in out.outputs:
            assert o.finish_reason == "stop", o.text
            jsonschema.validate(json.loads(o.text), SCHEMA)
    return [[o.token_ids for o in out.outputs] for out in outs]


def test_valid_with_n3_preemption_and_prefix_cache_same_tokens(tiny_models):
    roomy = LLM(str(tiny_models["llama"]), progress=False, num_blocks=256)
    expected = _run(roomy)
    assert roomy.engine.grammars.num_compiled == 1  # one schema, compiled once
    assert roomy.engine.block_pool.prefix_hits > 0  # later prompts reuse PREFIX's blocks
    # 18 samples of ~56 + 120 tokens in 40 blocks of 16: sequences are preempted and
    # recomputed; the matcher stays with its sequence, so the output does not change.
    tight = LLM(str(tiny_models["llama"]), progress=False, num_blocks=40,
                max_num_batched_tokens=64)
    assert _run(tight) == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.is_idle() and roomy.engine.is_idle()


def test_min_tokens_and_logit_bias(tiny_models):
    llm = LLM(str(tiny_models["llama"]), progress=False, num_blocks=64)
    eos = {t: 100.0 for t in llm.engine.eos_token_ids}
    (out,) = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=10,
                                                      logit_bias=eos))
    assert len(out.outputs[0].token_ids) == 1  # EOS at once
    (out,) = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=10,
                                                      logit_bias=eos, min_tokens=4))
    ids = out.outputs[0].token_ids
    assert len(ids) == 5 and ids[-1] in llm.engine.eos_token_ids
    assert not set(ids[:4]) & llm.engine.eos_token_ids
    with pytest.raises(InvalidArgument) as e:
        llm.generate([[1, 2]], SamplingParams(logit_bias={10**6: 1.0}))
    assert e.value.field == "logit_bias"
    with pytest.raises(InvalidArgument) as e:
        llm.generate([[1, 2]], SamplingParams(
            response_format=ResponseFormat("json_schema", '{"type": "bogus"}')))
    assert e.value.field == "response_format" and "bogus" in e.value.message
    assert llm.engine.is_idle()


def test_compile_off_the_step_loop_and_abort_while_compiling(tiny_models):
    """A request whose grammar is still compiling waits aside: other requests run to their end
    meanwhile; it joins once its grammar is ready; an abort while it waits frees it."""
    llm = LLM(str(tiny_models["llama"]), progress=False, num_blocks=64)
    engine = llm.engine
    gate = threading.Event()
    real = engine.grammars._compile

    def slow(key, fmt):
        assert gate.wait(60)
        return real(key, fmt)

    engine.grammars._compile = slow
    one = SamplingParams(temperature=1.0, seed=1, max_tokens=120, response_format=FMT)
    engine.add_request("json", [1, 2, 3], one)
    engine.add_request("aborted", [4, 5, 6], one)  # the same schema: one compile for both
    engine.add_request("plain", [1, 2, 3], SamplingParams(temperature=0, max_tokens=5,
                                                          ignore_eos=True))
    assert engine.num_waiting() == 3
    finished = set()
    while "plain" not in finished:
        finished |= {o.request_id for o in engine.step() if o.finish_reason is not None}
    assert [s.request_id for s, _ in engine.compiling] == ["json", "aborted"]
    engine.abort("aborted")
    gate.set()
    outs: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert set(outs) == {"json"} and engine.grammars.num_compiled == 1
    text = llm.tokenizer.decode(outs["json"])
    jsonschema.validate(json.loads(text), SCHEMA)
    assert engine.is_idle()


def test_a_schema_is_built_on_the_compile_thread_never_the_step_loop(tiny_models, monkeypatch):
    """Converting a schema into a grammar can take seconds (a grammar bomb: minutes), and a
    worker's engine core runs its step loop on one thread: add_request leaves the conversion to
    the compile thread. A schema that cannot be built ends its request with the error, and
    the offline API still refuses it before anything starts."""
    import tandem.engine.grammar as grammar

    llm = LLM(str(tiny_models["llama"]), progress=False, num_blocks=64)
    engine = llm.engine
    threads: list[str] = []
    real = grammar.schema_grammar

    def recording(schema):
        threads.append(threading.current_thread().name)
        return real(schema)

    monkeypatch.setattr(grammar, "schema_grammar", recording)
    fresh = ResponseFormat("json_schema", json.dumps({"enum": ["built-off-the-loop"]}))
    bad = ResponseFormat("json_schema", json.dumps({"type": "bogus", "x": "off-the-loop"}))
    engine.add_request("json", [1, 2, 3], SamplingParams(max_tokens=20, response_format=fresh))
    engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=5, response_format=bad))
    errors, tokens = {}, {}
    while engine.has_work():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.error is not None:
                errors[o.request_id] = o.error
    assert len(threads) == 2 and threading.main_thread().name not in threads, threads
    assert set(errors) == {"bad"} and "bogus" in errors["bad"]
    assert llm.tokenizer.decode(tokens["json"]).startswith('"built-off-the-loop"')
    with pytest.raises(InvalidArgument) as e:
        llm.generate([[1, 2]], SamplingParams(response_format=bad))
    assert e.value.field == "response_format"
    assert engine.is_idle()
