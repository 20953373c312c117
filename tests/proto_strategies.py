"""Hypothesis strategies for any protobuf message, built from its descriptor: every field of every
type, nested messages, maps, oneofs and proto3 optionals, with the values that break things
mixed in (0, the type's extremes, NaN and infinities, empty, very long and NUL-holding strings,
lists and maps of a hundred thousand entries). A new field in a .proto is fuzzed without a
change here. `overrides` replaces the strategy of a field by its full name
("tandem.v1.KVLocation.address"), for values a test must control (addresses a worker dials)."""

from __future__ import annotations

from collections.abc import Mapping

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

F = FieldDescriptor
MAX_DEPTH = 3

_RANGES = {
    F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_INT32: (-2**31, 2**31 - 1), F.TYPE_SINT32: (-2**31, 2**31 - 1),
    F.TYPE_SFIXED32: (-2**31, 2**31 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
    F.TYPE_INT64: (-2**63, 2**63 - 1), F.TYPE_SINT64: (-2**63, 2**63 - 1),
    F.TYPE_SFIXED64: (-2**63, 2**63 - 1),
}


def _integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted({v for v in (lo, hi, 0, 1, 2, 15, 16, 17, 255, 4096, 2**31 - 1, 2**31)
                    if lo <= v <= hi})
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi), st.integers(0, 600))


def _scalar(field: FieldDescriptor) -> st.SearchStrategy:
    t = field.type
    if t in _RANGES:
        return _integers(*_RANGES[t])
    if t == F.TYPE_DOUBLE:
        return st.floats(allow_nan=True, allow_infinity=True)
    if t == F.TYPE_FLOAT:
        return st.floats(width=32, allow_nan=True, allow_infinity=True)
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        return st.one_of(st.text(max_size=12),
                         st.sampled_from(["", " ", "\x00", "x" * 300, "x" * 70_000]))
    if t == F.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.just(b"\x00" * 70_000))
    if t == F.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values])
    raise TypeError(f"no strategy for {field.full_name} (type {t})")


def _repeated(elements: st.SearchStrategy, field: FieldDescriptor) -> st.SearchStrategy:
    lists = st.lists(elements, max_size=6)
    if field.type == F.TYPE_MESSAGE:
        return st.lists(elements, max_size=3)
    # Long lists of one value: what a caller can send cheaply and a server may pay for.
    long = st.builds(lambda v, k: [v] * k, elements, st.sampled_from([1_000, 100_000]))
    return st.one_of(lists, lists, long)


def messages(descriptor: Descriptor, overrides: Mapping[str, st.SearchStrategy] | None = None,
             depth: int = 0) -> st.SearchStrategy:
    """Messages of `descriptor`'s type, any field set or not."""
    overrides = overrides or {}
    cls = GetMessageClass(descriptor)
    if depth > MAX_DEPTH:
        return st.just(cls())
    fields: dict[str, st.SearchStrategy] = {}
    for field in descriptor.fields:
        if field.containing_oneof is not None and not field.containing_oneof.name.startswith("_"):
            continue  # a real oneof: below, one member at most
        fields[field.name] = st.none() | _field(field, overrides, depth)
    oneofs = [o for o in descriptor.oneofs if not o.name.startswith("_")]

    @st.composite
    def build(draw):
        kwargs = {name: v for name, s in fields.items() if (v := draw(s)) is not None}
        for oneof in oneofs:
            member = draw(st.none() | st.sampled_from(list(oneof.fields)))
            if member is not None:
                kwargs[member.name] = draw(_field(member, overrides, depth))
        return cls(**kwargs)

    return build()


def _field(field: FieldDescriptor, overrides: Mapping[str, st.SearchStrategy],
           depth: int) -> st.SearchStrategy:
    if field.full_name in overrides:
        return overrides[field.full_name]
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = field.message_type.fields_by_name["key"], \
            field.message_type.fields_by_name["value"]
        small = st.dictionaries(_field(key, overrides, depth + 1),
                                _field(value, overrides, depth + 1), max_size=4)
        if key.type == F.TYPE_STRING:
            many = st.builds(lambda n: {f"k{i}": _zero(value) for i in range(n)},
                             st.sampled_from([1_000, 20_000]))
            return st.one_of(small, small, many)
        return small
    if field.type == F.TYPE_MESSAGE:
        single = messages(field.message_type, overrides, depth + 1)
    else:
        single = _scalar(field)
    if field.is_repeated:
        return _repeated(single, field)
    return single


def _zero(field: FieldDescriptor):
    return "v" if field.type == F.TYPE_STRING else 0
