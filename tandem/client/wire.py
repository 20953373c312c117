"""The client's SamplingParams (a generated dataclass, tandem/client/params.py) in its wire
form, field by field from the proto's own description: a new parameter needs no code here."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from tandem.v1 import common_pb2


def params_to_proto(params: Any) -> common_pb2.SamplingParams:
    """Every field that is set (not None, not empty) into tandem.v1.SamplingParams."""
    p = common_pb2.SamplingParams()
    by_name = p.DESCRIPTOR.fields_by_name
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if value is None:
            continue
        desc = by_name[f.name]
        if desc.message_type is not None and desc.message_type.GetOptions().map_entry:
            getattr(p, f.name).update(dict(value))
        elif desc.message_type is not None:  # a message of one repeated field (a oneof member)
            inner = getattr(p, f.name)
            getattr(inner, inner.DESCRIPTOR.fields[0].name).extend(value)
        elif desc.is_repeated:
            getattr(p, f.name).extend(value)
        elif isinstance(value, Mapping):  # JSON text given as an object
            setattr(p, f.name, json.dumps(value))
        else:
            setattr(p, f.name, value)
    return p
