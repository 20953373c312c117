"""The offline engine as a user sees it: sampling behaviour, n > 1 sharing blocks, stop strings,
bad input named by field, and the engine serving on after errors. Every test leaves the pool
idle."""

from __future__ import annotations

import json
import shutil

import pytest

from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams
from tandem.errors import InvalidArgument, ModelLoadError


@pytest.fixture(scope="module")
def llm(tiny_models):
    engine = LLM(str(tiny_models["llama"]), progress=False, max_model_len=256, max_n=8)
    yield engine
    assert engine.engine.is_idle()


@pytest.fixture(autouse=True)
def pool_idle_after(request):
    yield
    if "llm" in request.fixturenames:
        llm = request.getfixturevalue("llm")
        assert llm.engine.is_idle(), "KV pool not back to idle"


PROMPTS = [[5 + i, 17, 33 + i, 2 * i + 1] * (2 + i) for i in range(6)]


def tokens(outs):
    return [[o.token_ids for o in out.outputs] for out in outs]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20)
    alone = tokens(llm.generate([PROMPTS[2]], p))
    again = tokens(llm.generate([PROMPTS[2]], p))
    assert alone == again
    unseeded = SamplingParams(temperature=1.0, max_tokens=20)
    mixed = llm.generate(PROMPTS, [p if i == 2 else unseeded for i in range(len(PROMPTS))])
    assert tokens(mixed)[2] == alone[0]
    other_seed = tokens(llm.generate([PROMPTS[2]], SamplingParams(temperature=0.9, top_p=0.95,
                                                                   seed=4321, max_tokens=20)))
    assert other_seed != alone


def test_n_samples_share_prompt_blocks(llm):
    engine = llm.engine
    bs = engine.block_pool.block_size
    prompt = list(range(1, 41))  # 2 full blocks + 8 tokens in a partial one
    engine.add_request("fork", prompt, SamplingParams(n=4, temperature=1.0, seed=3,
                                                      max_tokens=8, ignore_eos=True))
    engine.step()  # the whole prompt, then 4 first tokens from one set of logits
    seqs = engine.requests["fork"]
    assert len(seqs) == 4
    assert all(s.block_ids == seqs[0].block_ids for s in seqs)
    assert engine.block_pool.num_used == 3  # not 12: the prompt's blocks are shared
    assert [engine.block_pool.ref_counts[b] for b in seqs[0].block_ids] == [4, 4, 4]
    engine.step()  # each sample writes its token into the shared partial block: copy on write
    assert engine.block_pool.num_used == 2 + 4
    assert len({s.block_ids[2] for s in seqs}) == 4
    assert all(s.block_ids[:2] == seqs[0].block_ids[:2] for s in seqs)
    while engine.has_work():
        engine.step()
    assert len(prompt) // bs == 2


def test_n_samples_differ_and_match_seeded_reruns(llm):
    p = SamplingParams(n=4, temperature=1.0, seed=99, max_tokens=12, ignore_eos=True)
    a = tokens(llm.generate([PROMPTS[1]], p))[0]
    b = tokens(llm.generate([PROMPTS[1]], p))[0]
    assert a == b and len({tuple(t) for t in a}) > 1 and all(len(t) == 12 for t in a)


def test_stop_string_cuts_text_exactly(llm):
    base = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=40,
                                                     ignore_eos=True))[0].outputs[0]
    text = base.text
    # A stop string taken from the middle of the text: the output ends right before it.
    cut = next(i for i in range(len(text) // 3, len(text)) if text[i:i + 2].isprintable())
    stop = text[cut:cut + 2]
    first = text.find(stop)
    out = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=40,
                                                    ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.text == text[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text


def test_stop_token_ids_and_max_tokens(llm):
    base = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10,
                                                     ignore_eos=True))[0].outputs[0]
    assert len(base.token_ids) == 10 and base.finish_reason == "length"
    stop_tok = base.token_ids[4]
    first = base.token_ids.index(stop_tok)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                    stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == base.token_ids[:first + 1] and out.finish_reason == "stop"


def test_logprobs_returned_per_token(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5,
                                                    logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.sampled.token_id == tok and lp.top[0].token_id == tok and len(lp.top) == 3


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"n": 0}, "n"),
    ({"logprobs": 50}, "logprobs"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidArgument) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field and field in str(e.value)


def test_bad_requests_name_the_field_and_engine_serves_on(llm):
    ok = SamplingParams(temperature=0, max_tokens=4)
    cases = [
        ([[]], ok, "prompt"),
        ([""], ok, "prompt"),
        ([[1] * 256], ok, "prompt"),  # max_model_len is 256 here
        ([[1, 99999]], ok, "prompt_token_ids"),
        ([[1, 2]], SamplingParams(n=9), "n"),  # max_n is 8 here
    ]
    for prompts, params, field in cases:
        with pytest.raises(InvalidArgument) as e:
            llm.generate(prompts, params)
        assert e.value.field == field, e.value
        assert llm.engine.is_idle()
    # A bad prompt in a batch fails the batch before anything is allocated or left behind.
    with pytest.raises(InvalidArgument):
        llm.generate([[1, 2, 3], []], ok)
    assert llm.engine.is_idle()
    assert llm.generate([[1, 2, 3]], ok)[0].outputs[0].finish_reason in ("length", "stop")


def test_a_failed_step_fails_the_requests_in_it_alone(tiny_models):
    """A step whose forward pass raises ends the requests in it with an error output; a request
    that was waiting for a sequence slot meanwhile runs afterwards, to its output when alone."""
    llm = LLM(str(tiny_models["llama"]), progress=False, max_model_len=256, max_num_seqs=2)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = tokens(llm.generate([PROMPTS[3]], params))[0][0]
    for i, prompt in enumerate([PROMPTS[0], PROMPTS[1], PROMPTS[3]]):
        engine.add_request(f"r{i}", prompt, params)
    execute = engine.runner.execute

    def broken(*args, **kwargs):
        engine.runner.execute = execute  # once
        raise RuntimeError("a kernel failed")

    engine.runner.execute = broken
    failed = engine.step()
    assert sorted((o.request_id, o.error) for o in failed) == [
        ("r0", "internal error in the engine step"), ("r1", "internal error in the engine step")]
    assert list(engine.requests) == ["r2"]
    got = []
    while engine.has_work():
        got += [t for o in engine.step() for t in o.new_token_ids]
    assert got == expected and engine.is_idle()


def test_unknown_model_and_corrupt_weights(tmp_path, tiny_models):
    with pytest.raises(ModelLoadError, match="no-such-model"):
        LLM("/nonexistent/no-such-model", progress=False)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_models["llama"], broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        LLM(str(broken), progress=False)
    unsupported = tmp_path / "unsupported"
    shutil.copytree(tiny_models["llama"], unsupported)
    cfg = json.loads((unsupported / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (unsupported / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        LLM(str(unsupported), progress=False)


def test_missing_and_misshaped_tensors_are_named(tmp_path, tiny_models):
    from safetensors.torch import load_file, save_file

    src = load_file(tiny_models["llama"] / "model.safetensors")
    for name, mutate, expect in [
        ("missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
         "model.layers.1.mlp.gate_up_proj.weight (up)"),
        ("misshaped", lambda t: t.update({"model.layers.0.self_attn.k_proj.weight":
                                          t["model.layers.0.self_attn.k_proj.weight"][:64]}),
         "model.layers.0.self_attn.k_proj.weight"),
    ]:
        d = tmp_path / name
        shutil.copytree(tiny_models["llama"], d)
        tensors = dict(src)
        mutate(tensors)
        save_file(tensors, d / "model.safetensors")
        with pytest.raises(ModelLoadError) as e:
            LLM(str(d), progress=False)
        assert expect in str(e.value)
