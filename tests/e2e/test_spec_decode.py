"""Speculative decoding (engine/spec_decode/): the output is the same with and without it.

Greedy outputs are token-identical on the tiny random checkpoint of every architecture, with
prompt-lookup proposals and with an "oracle" proposer that knows the answer but garbles some
of it (random models rarely repeat themselves, so without it few drafts would be accepted;
with it, every accept length from 0 to k happens, across block boundaries). Seeded sampling,
with penalties, logit_bias, min_tokens, stop tokens and logprobs, gives the same tokens as
without speculation too (position P's noise is seeded by P alone). Stop strings, grammars,
pipelined steps, the per-request opt-out, the batch-size back-off and the decode role of a
P/D pair (first token from the prefill engine) as well. After every step each running
sequence holds exactly the blocks its computed tokens need; every pool ends idle.
"""

from __future__ import annotations

import json

import pytest
import torch
from handoffs import hand_off_one_by_one
from ngram_scan import lookup

from tandem.engine.async_step import PLACEHOLDER
from tandem.engine.config import EngineConfig, SpeculativeConfig, cdiv
from tandem.engine.llm import LLM
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_params import ResponseFormat, SamplingParams
from tandem.engine.spec_decode.ngram import NgramProposer
from tandem.engine.spec_decode.proposer import ProposeInput
from tandem.engine.spec_decode.speculator import Speculator
from tandem.errors import InvalidArgument
from tiny import ARCHS

ARCH_NAMES = list(ARCHS)  # every tiny checkpoint: one per architecture
NEW_TOKENS = 32
K = 3
# Prompts of 3 .. 33 tokens, two of them repetitive (prompt lookup finds matches there).
PROMPTS = [[1 + (7 * i + 3 * j) % 250 for j in range(3 + 6 * i)] for i in range(6)]
PROMPTS += [[5, 6, 7, 8, 9, 10] * 5, [11, 12, 13] * 10]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


class Oracle:
    """Proposes a sequence's known continuation (from a run without speculation), with the
    draft token at some (length, position) pairs replaced by a wrong one: accept lengths of
    every size."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.answers, self.vocab = answers, vocab
        self.calls = 0

    def propose(self, inp: ProposeInput) -> list[list[int]]:
        self.calls += 1
        out = []
        for seq, k in zip(inp.seqs, inp.max_tokens):
            ref = self.answers[tuple(seq.token_ids[:seq.num_prompt_tokens])][seq.sample_index]
            n = seq.num_output_tokens
            draft = list(ref[n:n + k])
            for j in range(len(draft)):
                if (seq.num_tokens * 7 + j * 3) % 5 == 0:
                    draft[j] = (draft[j] + 1) % self.vocab
            out.append(draft)
        return out

    def release(self, seq) -> None:
        pass


def check_blocks(engine: LLMEngine) -> None:
    """After a step: each running sequence holds the blocks its computed tokens need, no
    more (rejected drafts' blocks went back), and the pool counts exactly the blocks held."""
    bs = engine.block_pool.block_size
    held: set[int] = set()
    for seq in engine.scheduler.running:
        if seq.num_computed_tokens:
            assert len(seq.block_ids) == cdiv(seq.num_computed_tokens, bs), seq
        held.update(seq.block_ids)
    inflight = engine.pipeline.inflight
    if inflight is not None:  # a pipelined step's, finishing with it
        held.update(b for seq in inflight.seqs for b in seq.block_ids)
    assert engine.block_pool.num_used == len(held)


def watch(llm: LLM) -> None:
    llm.engine.on_step = lambda outputs: check_blocks(llm.engine)


def outputs(llm: LLM, prompts, params) -> list[list[list[int]]]:
    outs = llm.generate(prompts, params)
    assert llm.engine.is_idle(), "KV pool not back to idle"
    return [[c.token_ids for c in o.outputs] for o in outs]


def spec_llm(path, proposer=None, **kwargs) -> LLM:
    llm = LLM(str(path), progress=False, speculative_method="ngram",
              num_speculative_tokens=K, **kwargs)
    if proposer is not None:
        llm.engine.spec.proposer = proposer
    watch(llm)
    return llm


def answers_of(prompts, outs) -> dict:
    return {tuple(p): o for p, o in zip(prompts, outs)}


@pytest.mark.parametrize("name", ARCH_NAMES)
def test_greedy_identical_every_arch(tiny_models, name):
    llm = spec_llm(tiny_models[name])
    # The per-request opt-out: the same engine, one token per step.
    base = outputs(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                ignore_eos=True, speculative=False))
    assert llm.engine.spec.counters.num_verifies == 0
    assert outputs(llm, PROMPTS, GREEDY) == base  # prompt lookup (few matches here)
    oracle = Oracle(answers_of(PROMPTS, base), 512)
    llm.engine.spec.proposer = oracle
    before = llm.engine.spec.counters.num_accepted_tokens
    assert outputs(llm, PROMPTS, GREEDY) == base
    c = llm.engine.spec.counters
    assert c.num_accepted_tokens - before > NEW_TOKENS * len(PROMPTS) // 3
    assert 0 < c.accepted_at[K - 1] < c.drafted_at[K - 1]  # all kept, and some cut short


def test_greedy_small_blocks_and_budget(tiny_models):
    """Block size 4 (a verify step spans up to two blocks) and a token budget smaller than
    the batch's drafts (drafts cut to fit): same tokens, exact blocks."""
    path = tiny_models["llama"]
    base = outputs(LLM(str(path), progress=False, block_size=4), PROMPTS, GREEDY)
    oracle = Oracle(answers_of(PROMPTS, base), 512)
    llm = spec_llm(path, oracle, block_size=4, max_num_batched_tokens=12)
    assert outputs(llm, PROMPTS, GREEDY) == base
    assert llm.engine.spec.counters.num_accepted_tokens > 0


SAMPLED = [
    SamplingParams(temperature=0.9, top_p=0.9, seed=42, max_tokens=NEW_TOKENS, logprobs=2),
    SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=NEW_TOKENS,
                   presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.2),
    SamplingParams(temperature=0.7, min_p=0.05, seed=3, max_tokens=NEW_TOKENS, min_tokens=20,
                   stop_token_ids=(5, 16, 33, 90), logit_bias=((17, 3.0), (40, -100.0))),
    SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=NEW_TOKENS,
                   stop_token_ids=(5, 16, 33, 90)),
]


def test_seeded_sampling_identical(tiny_models):
    """Seeded requests: the same tokens (and logprobs) with speculation as without, with
    drafts that are often right; so reproducible too."""
    path = tiny_models["qwen2"]
    params = [SAMPLED[i % len(SAMPLED)] for i in range(len(PROMPTS))]
    plain = LLM(str(path), progress=False)
    base = plain.generate(PROMPTS, params)
    ref = {tuple(p): [c.token_ids for c in o.outputs] for p, o in zip(PROMPTS, base)}
    llm = spec_llm(path, Oracle(ref, 512))
    for _ in range(2):
        got = llm.generate(PROMPTS, params)
        assert llm.engine.is_idle()
        for a, b in zip(base, got):
            for ca, cb in zip(a.outputs, b.outputs):
                assert ca.token_ids == cb.token_ids
                assert ca.finish_reason == cb.finish_reason
                if ca.logprobs is not None:
                    for la, lb in zip(ca.logprobs, cb.logprobs):
                        assert la.sampled.token_id == lb.sampled.token_id
                        assert la.sampled.logprob == pytest.approx(lb.sampled.logprob, abs=1e-4)
                        assert [t.token_id for t in la.top] == [t.token_id for t in lb.top]
    assert llm.engine.spec.counters.num_accepted_tokens > 0


def test_stop_strings_and_pipelined_steps(tiny_models):
    """A stop string inside a step's kept tokens ends the text where it would have; pipelined
    steps (resolved before a step that speculates) change nothing."""
    path = tiny_models["llama"]
    plain = LLM(str(path), progress=False)
    text = plain.generate(PROMPTS[:1], GREEDY)[0].outputs[0].text
    stop = text[10:13]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, stop=[stop])
    base = plain.generate(PROMPTS, params)
    ref = {tuple(p): [c.token_ids for c in o.outputs] for p, o in zip(PROMPTS, base)}
    llm = spec_llm(path, Oracle(ref, 512), async_scheduling=True)
    got = llm.generate(PROMPTS, params)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in base]
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in base]
    assert llm.engine.is_idle()


class EveryThird(Oracle):
    """The oracle's drafts for sequences of a length divisible by 3 only, and an exact guess of
    whether one will come once the token in flight is known (one more token)."""

    def propose(self, inp: ProposeInput) -> list[list[int]]:
        drafts = super().propose(inp)
        return [d if s.num_tokens % 3 == 0 else [] for s, d in zip(inp.seqs, drafts)]

    def expects_draft(self, seqs) -> bool:
        assert all(s.token_ids[-1] == PLACEHOLDER for s in seqs)  # only with a step in flight
        return any(s.num_tokens % 3 == 0 for s in seqs)  # the same length once it is known


def test_steps_without_a_draft_stay_pipelined(tiny_models):
    """Pipelined steps: a step in flight is resolved for drafts only when the proposer expects
    one (a synchronous step that then drafts nothing costs speed for nothing); the steps in
    between stay pipelined, and the tokens are the same."""
    path = tiny_models["llama"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = outputs(LLM(str(path), progress=False), PROMPTS[:1], params)
    llm = spec_llm(path, EveryThird(answers_of(PROMPTS[:1], base), 512), async_scheduling=True,
                   speculative_min_acceptance=0)
    e = llm.engine
    speculate, resolved_for_nothing = e._speculate, []

    def counted():
        ran = speculate()
        if ran and not any(s.spec_token_ids for s in e.scheduler.running):
            resolved_for_nothing.append(e.spec.backoff.step)
        return ran

    e._speculate = counted
    assert outputs(llm, PROMPTS[:1], params) == base
    c = e.spec.counters
    assert not resolved_for_nothing, resolved_for_nothing
    assert c.num_pipelined_steps > 5 and c.num_resolved_steps > 0 and c.num_accepted_tokens > 0


def test_grammar_identical(tiny_models):
    """A structured output speculates with drafts cut at the first token its grammar refuses;
    the tokens equal a run without speculation."""
    path = tiny_models["llama"]
    schema = {"type": "object", "properties": {"id": {"type": "integer"},
                                               "note": {"type": "string", "maxLength": 6}},
              "required": ["id", "note"], "additionalProperties": False}
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=60,
                            response_format=ResponseFormat("json_schema", json.dumps(schema)))
    prompts = PROMPTS[:4]
    base = outputs(LLM(str(path), progress=False), prompts, params)
    oracle = Oracle(answers_of(prompts, base), 512)
    llm = spec_llm(path, oracle)
    assert outputs(llm, prompts, params) == base
    assert llm.engine.spec.counters.num_accepted_tokens > 0


def test_back_off_by_batch_size(tiny_models):
    """With more running sequences than speculative_max_batch, no step speculates; as they
    finish, speculation resumes."""
    path = tiny_models["llama"]
    base = outputs(LLM(str(path), progress=False), PROMPTS[:4], GREEDY)
    llm = spec_llm(path, Oracle(answers_of(PROMPTS[:4], base), 512), speculative_max_batch=2)
    verifying_with: list[int] = []  # running sequences at each step that got drafts
    propose = llm.engine.spec.propose

    def counted(running, max_model_len) -> int:
        n = propose(running, max_model_len)
        if n:
            verifying_with.append(len(running))
        return n

    llm.engine.spec.propose = counted
    lengths = [SamplingParams(temperature=0, max_tokens=8 * (i + 1), ignore_eos=True)
               for i in range(4)]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], lengths)]
    assert got == [b[0][:8 * (i + 1)] for i, b in enumerate(base)]
    assert verifying_with and max(verifying_with) <= 2


def test_no_speculation_while_a_prompt_prefills(tiny_models):
    """A prompt chunked over several steps beside a decoding request: no step speculates
    while it waits or prefills (its budget goes to the prompt), speculation runs before and
    after, and both outputs are the model's own."""
    path = tiny_models["llama"]
    prompts = [PROMPTS[1], [1 + (5 * j) % 250 for j in range(64)]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = outputs(LLM(str(path), progress=False), prompts, params)
    llm = spec_llm(path, Oracle(answers_of(prompts, base), 512), max_num_batched_tokens=16)
    engine = llm.engine
    drafted: list[bool] = []  # per step: whether a prompt was pending when drafts were made
    propose = engine.spec.propose

    def counted(running, max_model_len) -> int:
        n = propose(running, max_model_len)
        pending = bool(engine.scheduler.waiting) or any(
            s.num_computed_tokens < s.num_tokens - 1 for s in running)
        if n:
            drafted.append(pending)
        return n

    engine.spec.propose = counted
    engine.add_request("short", prompts[0], params)
    got: dict[str, list[int]] = {"short": [], "long": []}
    for step in range(200):
        if step == 6:  # the short one is decoding with drafts by now
            assert drafted
            before = len(drafted)
            engine.add_request("long", prompts[1], params)
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
        if step > 6 and not engine.has_work():
            break
    assert [got["short"], got["long"]] == [b[0] for b in base]
    assert engine.is_idle()
    assert not any(drafted), "a step speculated while a prompt was waiting or prefilling"
    assert len(drafted) > before  # and speculation resumed after the prefill


def test_decode_role_speculates(tiny_models):
    """P/D: the prefill engine samples the first token; the decode engine, speculating,
    gives the colocated engine's tokens; both pools end idle."""
    model = str(tiny_models["mistral"])
    base = outputs(LLM(model, progress=False), PROMPTS, GREEDY)
    prefill = LLMEngine(EngineConfig(model, role="prefill",
                                     speculative_method="ngram"), progress=False)
    assert prefill.spec is None  # first tokens only: nothing to speculate
    decode = LLMEngine(EngineConfig(model, role="decode", speculative_method="ngram",
                                    num_speculative_tokens=K), progress=False)
    decode.spec.proposer = Oracle(answers_of(PROMPTS, base), 512)
    decode.kv_connector.connect(lambda remote, src, dst: decode.runner.pool.__setitem__(
        torch.tensor(dst, dtype=torch.long), prefill.runner.pool[torch.tensor(src)]))
    decode.on_step = lambda outs: check_blocks(decode)
    got = hand_off_one_by_one(prefill, decode, PROMPTS, GREEDY)
    assert got == base
    assert decode.spec.counters.num_accepted_tokens > 0
    assert prefill.is_idle() and decode.is_idle()


def _drain(engine: LLMEngine, rid: str) -> list:
    outs = []
    while rid in engine.requests:
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


class Fixed:
    """Proposes the same draft to every sequence."""

    def __init__(self, draft: list[int]) -> None:
        self.draft = draft

    def propose(self, inp: ProposeInput) -> list[list[int]]:
        return [self.draft[:k] for k in inp.max_tokens]

    def release(self, seq) -> None:
        pass


def test_aborted_mid_speculation_frees_everything(tiny_models):
    llm = spec_llm(tiny_models["llama"], Fixed([1, 2, 3]))
    e = llm.engine
    e.add_request("a", PROMPTS[6], GREEDY)
    e.add_request("b", PROMPTS[7], GREEDY)
    while e.spec.counters.num_verifies == 0:
        e.step()
    e.abort("a")
    e.abort("b")
    assert e.is_idle()


# -- units ---------------------------------------------------------------------------------
def test_lookup_finds_latest_longest_match():
    import numpy as np

    toks = np.array([1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 1, 2, 3])
    assert lookup(toks, 2, 1, 3) == [4, 5]  # "1 2 3": the latest earlier match is at 4
    assert lookup(toks, 5, 1, 3) == [4, 5, 7, 1, 2]
    assert lookup(np.array([1, 2, 3, 4]), 3, 1, 3) == []
    assert lookup(np.array([8, 8, 8]), 3, 2, 2) == [8]  # the continuation runs to the end


def test_ngram_proposer_follows_a_growing_sequence():
    class S:
        def __init__(self, ids):
            self.seq_id, self.token_ids = 1, ids

    ngram = NgramProposer(2, 3)
    s = S([4, 5, 6, 4, 5])
    assert ngram.propose(ProposeInput([s], [3])) == [[6, 4, 5]]
    s.token_ids += [7, 4, 5]
    assert ngram.propose(ProposeInput([s], [3])) == [[7, 4, 5]]


def test_config_errors_name_the_field(tiny_models):
    with pytest.raises(InvalidArgument, match="speculative_method"):
        EngineConfig("m", speculative_method="medusa")
    with pytest.raises(InvalidArgument, match="num_speculative_tokens"):
        EngineConfig("m", speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(InvalidArgument, match="draft_model"):
        EngineConfig("m", speculative_method="draft")
    with pytest.raises(InvalidArgument, match="draft_model"):
        EngineConfig("m", speculative_method="draft", draft_model="small",
                     tensor_parallel_size=2)
    with pytest.raises(InvalidArgument, match="draft_num_blocks"):
        EngineConfig("m", speculative_method="draft", draft_model="small", draft_num_blocks=0)
    with pytest.raises(InvalidArgument, match="speculative_min_acceptance"):
        EngineConfig("m", speculative_method="ngram", speculative_min_acceptance=1.5)
    with pytest.raises(InvalidArgument, match="speculative_probe_interval"):
        EngineConfig("m", speculative_method="ngram", speculative_probe_interval=0)
    with pytest.raises(InvalidArgument, match="draft_model"):
        EngineConfig("m", draft_model="x")
    with pytest.raises(InvalidArgument, match="speculative"):
        SamplingParams(speculative=1)
    assert Speculator.build(SpeculativeConfig("ngram")).proposer is not None
