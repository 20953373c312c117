"""The grammar engine against the demo's byte-level tokenizer: the sampler masks only rows with a
grammar, ids past the tokenizer's vocabulary (padding rows of the logits) are never allowed, EOS
only when the grammar is complete, a fork continues independently, a sampled token's matcher
update waits for the next fill (many rows filled together as if each token were taken at once),
compiled grammars are cached
(LRU) per schema, and bad schemas or a missing xgrammar are named."""

from __future__ import annotations

import builtins
import json
import random

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine.demo import EOT_ID, VOCAB_SIZE, demo_model_dir
from tandem.engine.grammar import (
    GrammarCompiler,
    bitmask_width,
    check_schema,
    check_strict,
    fill_bitmask,
    unenforced_keyword,
)
from tandem.engine.sampler import Sampler, SampleRow
from tandem.engine.sampling_params import ResponseFormat, SamplingParams
from tandem.errors import InvalidArgument

PADDED_VOCAB = VOCAB_SIZE + 50  # the model's logits wider than the tokenizer
ENUM = ResponseFormat("json_schema", json.dumps({"enum": ["ab", "cd"]}))
OBJECT = ResponseFormat("json_schema", json.dumps({
    "type": "object", "properties": {"a": {"type": "string", "maxLength": 3},
                                     "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}))


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(demo_model_dir(), PADDED_VOCAB, [EOT_ID], cache_size=2)


def _allowed(state) -> set[int]:
    mask = _mask(1)
    state.fill(mask, 0)
    return _row(mask, 0)


def _mask(rows: int) -> torch.Tensor:
    return torch.full((rows, bitmask_width(PADDED_VOCAB)), -1, dtype=torch.int32)


def _row(mask: torch.Tensor, row: int) -> set[int]:
    bits = (mask[row, :, None] >> torch.arange(32)) & 1
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


def test_a_refused_deferred_token_breaks_only_its_row(compiler):
    """Rows filled together (xgrammar's batch fill, rows of the step's bitmask not in order):
    the one whose deferred token the grammar refuses allows only EOS from then on; the others
    advance, and the rows of the bitmask without a grammar are left alone."""
    states = [compiler.state(ENUM) for _ in range(4)]
    for s, tok in zip(states, [ord('"'), ord("x"), ord('"'), ord('"')], strict=True):
        s.defer(tok)
    mask, rows = _mask(6), [5, 0, 3, 2]
    fill_bitmask(states, mask, rows, [EOT_ID])
    assert [s.broken for s in states] == [False, True, False, False]
    assert [_row(mask, r) for r in rows] == [{ord("a"), ord("c")}, {EOT_ID},
                                             {ord("a"), ord("c")}, {ord("a"), ord("c")}]
    assert _row(mask, 1) == _row(mask, 4) == set(range(PADDED_VOCAB))
    for s, tok in zip(states, [ord("a"), EOT_ID, ord("a"), ord("c")], strict=True):
        s.defer(tok)  # the broken row sampled the only token its mask allowed
    fill_bitmask(states, mask, rows, [EOT_ID])
    assert [s.broken for s in states] == [False, True, False, False]
    assert [_row(mask, r) for r in rows] == [{ord("b")}, {EOT_ID}, {ord("b")}, {ord("d")}]


@settings(max_examples=40, deadline=None)
@given(data=st.data(), num_rows=st.integers(2, 5))
def test_filling_deferred_rows_together_equals_taking_each_token_at_once(compiler, data,
                                                                          num_rows):
    """Random walks, one a row, mostly through the allowed tokens and now and then any id:
    deferring each token and filling the rows together gives, row for row and step for step,
    the mask and the broken flag of taking each token at once, one matcher at a time."""
    compiled = compiler.compile(OBJECT)
    deferred = [GrammarCompiler.state_of(compiled) for _ in range(num_rows)]
    at_once = [GrammarCompiler.state_of(compiled) for _ in range(num_rows)]
    broken = [False] * num_rows
    rows = data.draw(st.permutations(range(num_rows + 2)))[:num_rows]
    mask = _mask(num_rows + 2)
    live = list(range(num_rows))
    for _ in range(data.draw(st.integers(1, 16))):
        if not live:
            break
        fill_bitmask([deferred[i] for i in live], mask, [rows[i] for i in live], [EOT_ID])
        for i in list(live):
            allowed = _row(mask, rows[i])
            assert allowed == ({EOT_ID} if broken[i] else _allowed(at_once[i]))
            assert deferred[i].broken == broken[i]
            any_id = data.draw(st.integers(0, 9)) == 0
            tok = data.draw(st.integers(0, PADDED_VOCAB - 1) if any_id
                            else st.sampled_from(sorted(allowed)))
            if tok == EOT_ID:  # the sample ends here
                live.remove(i)
                continue
            deferred[i].defer(tok)
            if not broken[i]:
                broken[i] = not at_once[i].accept(tok)


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
    assert e.value.field == "response_format" and "xgrammar" in e.value.message
    # The router's check refuses json_object as it does a schema (it used to pass it on to a
    # worker, which failed on it).
    with pytest.raises(InvalidArgument) as e:
        check_schema(ResponseFormat("json_object", None, "</end>"))
    assert e.value.field == "response_format"


def _accept_text(state, text: str) -> bool:
    return all(state.accept(b) for b in text.encode())


def test_a_grammar_after_a_text_applies_from_its_end(compiler):
    """ResponseFormat.after: free text (a reasoning section the prompt opened) until the text
    that ends it, then the grammar; the sample cannot end before."""
    fmt = ResponseFormat("json_schema", ENUM.schema, after="</think>")
    s = compiler.state(fmt)
    assert EOT_ID not in _allowed(s)
    assert _accept_text(s, 'so: "ab" or </thin or "cd"? ')  # free, even JSON-like text
    assert EOT_ID not in _allowed(s)
    assert _accept_text(s, "</think>")
    assert _allowed(s) == {ord('"')}  # the grammar, from here on
    assert _accept_text(s, '"cd"') and _allowed(s) == {EOT_ID} and s.accept(EOT_ID)
    plain = compiler.state(ENUM)
    assert not _accept_text(plain, "so")  # without `after`: the grammar from the first token


# -- strict schemas: every keyword enforced, or the schema refused naming it -------------------
STRICT_SCHEMAS = [
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -3, "maximum": 40,
                                            "multipleOf": 3},
                                      "x": {"type": "number", "exclusiveMinimum": 0,
                                            "exclusiveMaximum": 2}},
     "required": ["n", "x"], "additionalProperties": False},
    {"type": "array", "items": {"type": "string", "minLength": 2, "maxLength": 3},
     "minItems": 1, "maxItems": 3},
    {"type": "array", "prefixItems": [{"const": "a"}, {"enum": [1, None, True]}],
     "items": False},
    {"anyOf": [{"type": "string", "pattern": "^[a-c]{1,3}$"}, {"type": "boolean"},
               {"$ref": "#/$defs/pair"}],
     "$defs": {"pair": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                   "maximum": 9}, "minItems": 2,
                        "maxItems": 2}}},
    {"type": "object", "title": "t", "description": "d",
     "properties": {"tag": {"type": ["string", "null"], "maxLength": 2, "default": None}},
     "required": ["tag"], "additionalProperties": False},
]


def _walk(state, rng: random.Random, limit: int = 400) -> str:
    """A random path through the grammar (the demo's ids are bytes): closing characters
    favoured, so strings and numbers end."""
    out = bytearray()
    for _ in range(limit):
        allowed = _allowed(state)
        if EOT_ID in allowed and (allowed == {EOT_ID} or rng.random() < 0.5):
            return out.decode()
        choices = sorted(t for t in allowed if t < 256)
        closing = [t for t in choices if chr(t) in '"]},']
        token = rng.choice(closing if closing and rng.random() < 0.4 else choices)
        assert state.accept(token)
        out.append(token)
    raise AssertionError(f"no end after {limit} bytes: {out[:80]!r}")


@pytest.mark.parametrize("schema", STRICT_SCHEMAS)
def test_every_output_of_a_strict_schema_validates(compiler, schema):
    assert unenforced_keyword(schema) is None
    fmt = ResponseFormat("json_schema", json.dumps(schema))
    rng = random.Random(1)
    for _ in range(25):
        jsonschema.validate(json.loads(_walk(compiler.state(fmt), rng)), schema)


@pytest.mark.parametrize(("schema", "where"), [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "properties": {"a": {"not": {"const": 1}}}}, "properties.a.not"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
    ({"type": "array", "contains": {"const": 1}}, "contains"),
    ({"type": "string", "format": "date"}, "format"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "maxLength"),
    ({"anyOf": [{"type": "string", "format": "ipv4"}]}, "anyOf[0].format"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
])
def test_a_strict_schema_with_a_keyword_not_enforced_is_refused_naming_it(schema, where):
    assert unenforced_keyword(schema) == where
    with pytest.raises(InvalidArgument) as e:
        check_strict(json.dumps(schema))
    assert e.value.field == "response_format" and where in e.value.message
