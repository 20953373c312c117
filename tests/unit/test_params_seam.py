"""The request parameters are declared once, in engine/sampling_params.py (SamplingParams with
`param` metadata); every other surface is derived from that declaration or held equal to it
here. Each test fails when its surface's set of parameters, a type, or a default differs."""

from __future__ import annotations

import dataclasses
import re
import sys
import typing
from pathlib import Path

import pytest

from tandem.cli.generate import add_sampling_args, sampling_params
from tandem.cli.main import flag_name
from tandem.client import SamplingParams as ClientParams
from tandem.engine.sampling_params import (
    FORMAT_AFTER,
    FORMAT_KINDS,
    MAPPED,
    MAX_CHOICES,
    SAME,
    ResponseFormat,
    SamplingParams,
    param_spec,
    request_params,
)
from tandem.errors import InvalidArgument
from tandem.router_svc import openai_requests
from tandem.router_svc.api_errors import grpc_field
from tandem.runtime.convert import FORMAT_ONEOF, params_from_proto, params_to_proto
from tandem.v1 import common_pb2

ROOT = Path(__file__).resolve().parents[2]
PROTO = common_pb2.SamplingParams.DESCRIPTOR
HINTS = typing.get_type_hints(SamplingParams)
PARAMS = request_params()
SIMPLE = [f for f in PARAMS if f.name != FORMAT_ONEOF]
# proto scalar type -> the Python type the engine declares for it
PROTO_TYPES = {
    PROTO.fields_by_name["n"].TYPE_UINT32: int, PROTO.fields_by_name["n"].TYPE_INT32: int,
    PROTO.fields_by_name["n"].TYPE_UINT64: int, PROTO.fields_by_name["n"].TYPE_INT64: int,
    PROTO.fields_by_name["n"].TYPE_DOUBLE: float, PROTO.fields_by_name["n"].TYPE_BOOL: bool,
    PROTO.fields_by_name["n"].TYPE_STRING: str,
}


def _base(hint: object) -> object:
    """int for `int | None`, the element for a tuple, (key, value) for a tuple of pairs."""
    args = [a for a in typing.get_args(hint) if a not in (type(None), Ellipsis)]
    if typing.get_origin(hint) is tuple:
        inner = args[0]
        return typing.get_args(inner) if typing.get_origin(inner) is tuple else inner
    return args[0] if args else hint


def _example(name: str) -> SamplingParams:
    f = next(f for f in PARAMS if f.name == name)
    return SamplingParams(**{name: param_spec(f).example})


def test_the_proto_has_a_field_for_each_parameter_and_no_other():
    wire = {f.name for f in SIMPLE} | set(FORMAT_KINDS) | {FORMAT_AFTER}
    assert set(PROTO.fields_by_name) == wire
    oneof = PROTO.oneofs_by_name[FORMAT_ONEOF]
    assert [f.name for f in oneof.fields] == list(FORMAT_KINDS)


@pytest.mark.parametrize("f", SIMPLE, ids=lambda f: f.name)
def test_each_proto_field_has_the_declared_type_and_default(f):
    desc = PROTO.fields_by_name[f.name]
    hint = HINTS[f.name]
    is_map = desc.message_type is not None and desc.message_type.GetOptions().map_entry
    if is_map:
        key, value = desc.message_type.fields
        assert (PROTO_TYPES[key.type], PROTO_TYPES[value.type]) == _base(hint)
        return
    assert desc.is_repeated == (typing.get_origin(hint) is tuple), f.name
    assert PROTO_TYPES[desc.type] is _base(hint), f.name
    if type(None) in typing.get_args(hint):
        assert desc.has_presence, f"{f.name} may be None: the proto must tell unset apart"
    if not desc.is_repeated and not desc.has_presence and desc.default_value != f.default:
        # Zero on the wire is "unset" (the default): it must not be a value a caller may mean.
        with pytest.raises(ValueError, match=f.name):
            SamplingParams(**{f.name: desc.default_value})


def test_the_proto_comments_show_the_declared_defaults():
    text = (ROOT / "protos/tandem/v1/common.proto").read_text()
    body = text[text.index("message SamplingParams"):text.index("message Logprob")]
    shown = dict(re.findall(r"^\s*(?:optional |repeated )?\w+ (\w+) = \d+;.*\[(.+?)\]", body,
                            re.M))
    assert shown, "no [default] in the proto's comments"
    for name, text_default in shown.items():
        default = next(f.default for f in PARAMS if f.name == name)
        assert text_default == (str(default).lower() if isinstance(default, bool)
                                else str(default)), name


@pytest.mark.parametrize("f", PARAMS, ids=lambda f: f.name)
def test_each_parameter_crosses_the_wire(f):
    params = _example(f.name)
    assert params != SamplingParams(), f"{f.name}'s example is its default"
    assert params_from_proto(params_to_proto(params)) == params


def _client_kwargs(f: dataclasses.Field) -> dict:
    example = param_spec(f).example
    if isinstance(example, ResponseFormat):
        return {example.type: example.schema if example.schema is not None else True,
                FORMAT_AFTER: example.after}
    if f.name == "logit_bias":
        return {f.name: dict(example)}
    return {f.name: example}


def test_the_client_dataclass_is_generated_fresh_from_the_declaration():
    sys.path.insert(0, str(ROOT / "protos"))
    import generate

    committed = (ROOT / generate.CLIENT_PARAMS).read_text()
    assert committed == generate.client_params(), "run `python protos/generate.py`"
    fields = dataclasses.fields(ClientParams)
    assert [f.name for f in fields] == [d.name for d in sorted(PROTO.fields,
                                                              key=lambda d: _order(d.name))]
    assert all(f.default is None for f in fields), "the server's default, never the client's"


def _order(wire_name: str) -> int:
    names = [f.name for f in PARAMS]
    wire_name = FORMAT_ONEOF if wire_name in (*FORMAT_KINDS, FORMAT_AFTER) else wire_name
    return names.index(wire_name)


@pytest.mark.parametrize("f", PARAMS, ids=lambda f: f.name)
def test_each_parameter_reaches_the_engine_from_the_client(f):
    wire = ClientParams(**_client_kwargs(f)).to_proto()
    assert params_from_proto(wire) == _example(f.name)
    assert params_from_proto(ClientParams().to_proto()) == SamplingParams()


def test_the_openai_fields_are_the_declared_ones():
    same = {f.name for f in PARAMS if param_spec(f).openai == SAME}
    mapped = {f.name for f in PARAMS if param_spec(f).openai == MAPPED}
    assert same | mapped == {f.name for f in PARAMS}
    assert set(openai_requests.DERIVED_FIELDS) == same
    assert set(openai_requests.MAPPED_FIELDS) == mapped
    bodies = (openai_requests.CompletionRequest, openai_requests.ChatCompletionRequest)
    for body in bodies:
        for name in same:
            assert name in body.model_fields, (body.__name__, name)
            assert body.model_fields[name].default is None, "the engine's default"
    declared = {n for b in bodies for n in b.model_fields}
    assert {n for names in openai_requests.MAPPED_FIELDS.values() for n in names} <= declared


@pytest.mark.parametrize("f", [f for f in PARAMS if param_spec(f).openai == SAME],
                         ids=lambda f: f.name)
def test_each_derived_openai_field_reaches_the_engine(f):
    example = param_spec(f).example
    value = list(example) if isinstance(example, tuple) else example
    body = openai_requests.CompletionRequest(prompt="x", **{f.name: value})
    assert openai_requests.sampling_params(body, None, None) == _example(f.name)
    assert openai_requests.sampling_params(
        openai_requests.CompletionRequest(prompt="x"), None, None) == SamplingParams()


@pytest.mark.parametrize("name", [f.name for f in PARAMS])
def test_each_parameter_error_names_its_grpc_path(name):
    if name == FORMAT_ONEOF:
        assert grpc_field(name, "text", "json_object") == "params.json_object"
        assert grpc_field(name) == "params.json_schema"
    else:
        assert grpc_field(name) == f"params.{name}"
    assert grpc_field("prompt", "token_ids") == "token_ids"


def test_the_cli_flags_are_the_declared_ones():
    import argparse

    p = argparse.ArgumentParser()
    add_sampling_args(p)
    flags = {a.option_strings[0]: a for a in p._actions if a.option_strings[0] != "-h"}
    cli = [f for f in PARAMS if param_spec(f).cli]
    assert set(flags) == {flag_name(f.name) for f in cli}
    assert all(a.default is None for a in flags.values()), "the engine's default"
    for f in cli:
        example = param_spec(f).example
        if isinstance(example, bool):
            argv = [flag_name(f.name)]
        elif isinstance(example, tuple):
            argv = [x for v in example for x in (flag_name(f.name), str(v))]
        else:
            argv = [flag_name(f.name), str(example)]
        assert sampling_params(p.parse_args(argv)) == _example(f.name), f.name
    assert sampling_params(p.parse_args([])) == SamplingParams()


def test_each_format_kind_crosses_the_wire_and_a_choice_list_is_bounded():
    for kind, spec in (("regex", "a+"), ("choice", '["x", "y"]'), ("grammar", 'root ::= "a"'),
                       ("structural_tag", '{"type": "structural_tag", "format": {}}')):
        fmt = ResponseFormat(kind, spec, "</think>")
        assert params_from_proto(params_to_proto(SamplingParams(response_format=fmt))) \
            .response_format == fmt
    p = common_pb2.SamplingParams()
    p.choice.choices.extend(["a"] * (MAX_CHOICES + 1))
    with pytest.raises(InvalidArgument) as e:
        params_from_proto(p)
    assert e.value.field == "choice" and str(MAX_CHOICES) in e.value.message
