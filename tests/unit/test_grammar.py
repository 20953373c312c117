"""The grammar engine against the demo's byte-level tokenizer: the sampler masks only rows with a
grammar, ids past the tokenizer's vocabulary (padding rows of the logits) are never allowed, EOS
only when the grammar is complete, a fork continues independently, a sampled token's matcher
update waits for the next fill, compiled grammars are cached
(LRU) per schema, and bad schemas or a missing xgrammar are named."""

from __future__ import annotations

import builtins
import json

import pytest
import torch

from engine.demo import EOT_ID, VOCAB_SIZE, demo_model_dir
from engine.grammar import GrammarCompiler, check_schema
from engine.sampler import Sampler, SampleRow
from engine.sampling_params import ResponseFormat, SamplingParams
from tandem.errors import InvalidArgument

PADDED_VOCAB = VOCAB_SIZE + 50  # the model's logits wider than the tokenizer
ENUM = ResponseFormat("json_schema", json.dumps({"enum": ["ab", "cd"]}))


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(demo_model_dir(), PADDED_VOCAB, [EOT_ID], cache_size=2)


def _allowed(state) -> set[int]:
    mask = torch.full((1, (PADDED_VOCAB + 31) // 32), -1, dtype=torch.int32)
    state.fill(mask, 0)
    bits = (mask[0, :, None] >> torch.arange(32)) & 1
    return set(torch.nonzero(bits.flatten()[:PADDED_VOCAB]).flatten().tolist())


def test_mask_follows_the_grammar_and_eos_only_at_the_end(compiler):
    s = compiler.state(ENUM)
    assert _allowed(s) == {ord('"')}
    assert s.accept(ord('"'))
    assert _allowed(s) == {ord("a"), ord("c")}
    fork = s.fork()
    assert s.accept(ord("a")) and fork.accept(ord("c"))
    assert _allowed(s) == {ord("b")} and _allowed(fork) == {ord("d")}
    assert not s.accept(ord("d"))  # refused, state unchanged
    assert s.accept(ord("b")) and s.accept(ord('"'))
    assert _allowed(s) == {EOT_ID}  # complete: only EOS, never a padding id
    assert s.accept(EOT_ID) and s.terminated


def test_a_deferred_token_is_taken_at_the_next_fill(compiler):
    """A token sampled under the mask advances the matcher when the next mask is filled (on the
    host, while the device computes): the same masks as taking it at once; a fork first takes
    it; a deferred token the grammar refuses leaves a row that allows only EOS."""
    now, later = compiler.state(ENUM), compiler.state(ENUM)
    for tok, expect in [(ord('"'), {ord("a"), ord("c")}), (ord("a"), {ord("b")})]:
        assert now.accept(tok)
        later.defer(tok)
        assert later.pending == tok
        assert _allowed(now) == _allowed(later) == expect
        assert later.pending is None
    later.defer(ord("b"))
    fork = later.fork()
    assert later.pending is None and _allowed(fork) == _allowed(later) == {ord('"')}
    broken = compiler.state(ENUM)
    broken.defer(ord("x"))  # outside the grammar: only a bad mask could have sampled it
    sampler = Sampler(PADDED_VOCAB, torch.device("cpu"), [EOT_ID])
    logits = torch.zeros(1, PADDED_VOCAB)
    logits[0, ord('"')] = 50.0
    greedy = SamplingParams(temperature=0)
    assert sampler(logits, [SampleRow(greedy, 0, 1, grammar=broken)]).token_ids == [EOT_ID]
    assert broken.broken


def test_sampler_masks_only_grammar_rows(compiler):
    sampler = Sampler(PADDED_VOCAB, torch.device("cpu"), [EOT_ID])
    logits = torch.zeros(2, PADDED_VOCAB)
    logits[:, 7] = 50.0  # the model's favourite, outside the grammar
    logits[:, VOCAB_SIZE + 3] = 40.0  # a padding id, never allowed under a grammar
    greedy = SamplingParams(temperature=0)
    rows = [SampleRow(greedy, 0, 0, grammar=compiler.state(ENUM)), SampleRow(greedy, 0, 0)]
    out = sampler(logits, rows, greedy=logits.argmax(-1))
    assert out.token_ids == [ord('"'), 7]
    hot = SamplingParams(temperature=1.0, seed=1)
    for pos in range(20):
        s = compiler.state(ENUM)
        s.accept(ord('"'))
        (tok,) = sampler(logits[:1], [SampleRow(hot, 0, pos, grammar=s)]).token_ids
        assert tok in (ord("a"), ord("c"))


def test_compiled_once_per_schema_lru(compiler):
    fmts = [ResponseFormat("json_schema", json.dumps({"enum": [f"v{i}"]})) for i in range(3)]
    n = compiler.num_compiled
    compiler.compile(fmts[0])
    compiler.compile(fmts[0])
    compiler.state(fmts[0])
    assert compiler.num_compiled == n + 1
    compiler.compile(fmts[1])
    compiler.compile(fmts[2])  # the cache holds 2: fmts[0] goes
    compiler.compile(fmts[2])
    assert compiler.num_compiled == n + 3
    compiler.compile(fmts[0])
    assert compiler.num_compiled == n + 4


@pytest.mark.parametrize("schema", ['{"type": "bogus"}', '{"properties": 5, "type": "object"}',
                                    '{"type": "string", "pattern": "(unclosed"}'])
def test_bad_schemas_are_named(compiler, schema):
    fmt = ResponseFormat("json_schema", schema)
    for check in (check_schema, compiler.compile):
        with pytest.raises(InvalidArgument) as e:
            check(fmt)
        assert e.value.field == "response_format"


def test_response_format_validation():
    with pytest.raises(InvalidArgument, match="response_format"):
        ResponseFormat("json_schema", "not json")
    with pytest.raises(InvalidArgument, match="response_format"):
        ResponseFormat("yaml")
    with pytest.raises(InvalidArgument, match="at most"):
        ResponseFormat("json_schema", json.dumps({"enum": ["x" * 70_000]}))
    with pytest.raises(InvalidArgument, match="ignore_eos"):
        SamplingParams(ignore_eos=True, response_format=ResponseFormat("json_object"))


def test_missing_xgrammar_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_xgrammar(name, *args, **kwargs):
        if name == "xgrammar":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_xgrammar)
    fresh = GrammarCompiler(demo_model_dir(), PADDED_VOCAB, [EOT_ID])
    with pytest.raises(InvalidArgument) as e:
        fresh.compile(ResponseFormat("json_object"))
    assert e.value.field == "response_format" and "tandem[structured]" in e.value.message
