"""A JSON request body parsed within bounds: what a hostile body costs is set by the limits,
not by its size.

    bytes ─UTF-8─▶ text ─scan─▶ within the limits ─json.loads─▶ document ─▶ numbers and strings
                          │                                                 │
      an array or object with more items than its field allows, more items  NaN, Infinity, a
      in all than the body allows, nesting deeper than 64                   number past a double,
                          → 400 naming the top-level field, at the first    a lone surrogate
                            item too many                                   → 400 naming the field

The scan reads the body's structural tokens (a string is one token; a run of up to 1,024
scalars and their commas is one more) and stops at the first limit passed: a 4-million-item
array costs what its first items cost, and json.loads (C) only ever parses a body within the
limits. The numbers and strings are walked only when the parse met a non-finite number or the
text holds a surrogate escape. BodyError's `status`, `message` and `param` (the top-level
field) make the HTTP answer.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_JSON_DEPTH = 64
MAX_ITEMS = 4096  # items of an array or object that no limit names
MAX_FIELDS = 256  # keys of the body's own object
MAX_TOTAL_ITEMS = 1 << 16  # items of every array and object together (by default)


class BodyError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str = "invalid_value") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass(frozen=True)
class BodyLimits:
    """How many items the arrays and objects of a body may hold.

    `fields` maps a top-level field's name to the most items of its value, and the name with
    "[]" appended to the most items of every array or object inside that value (a prompt given
    as a list of token-id lists: "prompt[]"). Any other array or object: `default`. The body's
    own object: MAX_FIELDS keys. `total`: items of all of them together."""

    fields: Mapping[str, int] = field(default_factory=dict)
    default: int = MAX_ITEMS
    total: int = MAX_TOTAL_ITEMS
    depth: int = MAX_JSON_DEPTH

    def cap(self, top_field: str | None, depth: int) -> int:
        """The limit of an array or object opened at `depth` (1: the body itself) under
        `top_field`."""
        if depth == 1:
            return MAX_FIELDS
        if top_field is None:
            return self.default
        return self.fields.get(top_field if depth == 2 else f"{top_field}[]", self.default)


# Possessive quantifiers (*+, ++) never backtrack, so no body makes the scan quadratic: an
# unterminated string ends at the end of the text, and a run of scalars without a comma after
# it is one token.
_TOKENS = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+"?'  # a string
                     r'|(?:[^"\[\]{}:,]*+,){1,1024}'  # scalars, each with the comma after it
                     r'|[^"\[\]{}:,]++'  # a scalar (or blanks) without one
                     r'|[\[\]{}:]', re.DOTALL)
# \uD800-\uDFFF escapes: a lone one cannot be encoded. Pairs match too (and escaped
# backslashes before "u"); the walk then decides.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def scan(text: str, limits: BodyLimits) -> None:
    """BodyError at the first array or object past its limit, or past the total or the depth.
    Malformed JSON passes (json.loads names it); well-formed JSON is counted exactly."""
    stack: list[list[int]] = []  # each open array or object: [items after the first, limit]
    top_field: str | None = None  # the body's field the scan is in
    key = ""  # the last string of the body's own object: a key, once ":" follows
    total = 0
    for m in _TOKENS.finditer(text):
        tok = m.group()
        first = tok[0]
        if first == '"':
            if len(stack) == 1:
                key = tok
        elif first in "[{":
            if len(stack) >= limits.depth:
                raise BodyError(400, f"the request body is nested too deeply (limit "
                                f"{limits.depth})", top_field)
            stack.append([0, limits.cap(top_field, len(stack) + 1)])
        elif first in "]}":
            if stack:
                stack.pop()
        elif first == ":":
            if len(stack) == 1:
                top_field = _key(key)
        elif stack:  # scalars and commas: one more item for each comma
            commas = tok.count(",")
            open_ = stack[-1]
            open_[0] += commas
            total += commas
            if open_[0] >= open_[1]:
                where = "the request body" if len(stack) == 1 else (top_field or "body")
                raise BodyError(400, f"{where}: more than {open_[1]} items in one array or "
                                "object (the server's limit)", top_field if len(stack) > 1
                                else None)
            if total >= limits.total:
                raise BodyError(400, f"the request body holds more than {limits.total} items "
                                "in all (the server's limit)", top_field)


def _key(token: str) -> str | None:
    try:
        key = json.loads(token)
    except ValueError:
        return None  # unterminated: json.loads refuses the body
    return key if isinstance(key, str) else None


class _NonFinite:
    def __init__(self, text: str) -> None:
        self.text = text


def check_json(body: bytes, limits: BodyLimits | None = None) -> Any:
    """The parsed body, or BodyError naming what is wrong (and where)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    scan(text, limits or BodyLimits())
    non_finite = False

    def parse_float(s: str) -> float | _NonFinite:
        nonlocal non_finite
        v = float(s)
        if math.isfinite(v):
            return v
        non_finite = True
        return _NonFinite(s)

    def parse_constant(s: str) -> _NonFinite:
        nonlocal non_finite
        non_finite = True
        return _NonFinite(s)

    try:
        doc = json.loads(text, parse_float=parse_float, parse_constant=parse_constant)
    except RecursionError:  # the scan bounds the depth; this is only a second line
        raise BodyError(400, f"the request body is nested too deeply (limit "
                        f"{MAX_JSON_DEPTH})") from None
    except ValueError as e:
        raise BodyError(400, f"the request body is not valid JSON: {e}") from None
    if non_finite or _SURROGATE_ESCAPE.search(text):
        _walk(doc)
    return doc


def _walk(doc: Any) -> None:
    """BodyError at the first non-finite number or unencodable string (keys too)."""
    stack: list[tuple[Any, list[str | int]]] = [(doc, [])]
    while stack:
        node, parts = stack.pop()
        if isinstance(node, _NonFinite):
            raise BodyError(400, f"{_path(parts) or 'body'}: must be a finite number, got "
                            f"{node.text}", _top(parts))
        if isinstance(node, str):
            _check_str(node, parts)
        elif isinstance(node, dict):
            for k, v in node.items():
                _check_str(k, parts)
                stack.append((v, [*parts, k]))
        elif isinstance(node, list):
            stack.extend((v, [*parts, i]) for i, v in enumerate(node))


def _check_str(s: str, parts: list[str | int]) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise BodyError(400, f"{_path(parts) or 'body'}: contains a lone surrogate "
                        "(not valid Unicode)", _top(parts)) from None


def _path(parts: list[str | int]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _top(parts: list[str | int]) -> str | None:
    return parts[0] if parts and isinstance(parts[0], str) else None
