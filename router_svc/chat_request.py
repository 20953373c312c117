"""OpenAI request fields that shape the prompt and the grammar: response_format, tools and
tool_choice, tool turns in the messages, chat_template_kwargs; and how the answer is read back
(ChatOutputSpec). Errors are InvalidArgument naming the OpenAI field.

tool_choice and the grammar:
    none      tools still go to the template (the model knows them) but are never parsed
    auto      the model's own tool-call syntax is parsed from its text (router_svc/tool_parsers)
    required  the grammar writes [{"name": one of the tools, "arguments": valid for it}, ...]
    named     the grammar writes that function's arguments object
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine.sampling_params import ResponseFormat
from engine.tokenizer import Tokenizer
from router_svc.chat_output import ChatOutputSpec
from router_svc.reasoning import START as THINK_START
from router_svc.reasoning import uses_reasoning
from router_svc.tool_parsers import detect_family
from tandem.errors import InvalidArgument

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
ANY_OBJECT = {"type": "object"}
# Keys the template call sets itself.
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "documents",
                                       "add_generation_prompt", "tokenize", "return_dict",
                                       "chat_template", "continue_final_message"})
MISTRAL_MARKER = "[TOOL_CALLS]"


def response_format(value: Any, field: str = "response_format") -> ResponseFormat | None:
    """OpenAI's response_format: {"type": "text" | "json_object" | "json_schema", ...}."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidArgument(field, "must be an object with a type")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidArgument(field, "json_schema must be an object with a name and a schema")
        schema = spec.get("schema", ANY_OBJECT)
        if not isinstance(schema, dict | bool):
            raise InvalidArgument(field, "json_schema.schema must be a JSON Schema object")
        return ResponseFormat("json_schema", json.dumps(schema))
    raise InvalidArgument(field, f"type must be text, json_object or json_schema, got {kind!r}")


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict | None


def parse_tools(tools: Any) -> list[Tool]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidArgument("tools", "must be a list of function tools")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" \
                or not isinstance(fn, dict):
            raise InvalidArgument("tools", f"[{i}] must be {{\"type\": \"function\", "
                                  "\"function\": {...}}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidArgument("tools", f"[{i}].function.name must be 1-64 letters, digits, "
                                  "'_', '-' or '.'")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidArgument("tools", f"[{i}].function.parameters must be a JSON Schema "
                                  "object")
        if any(o.name == name for o in out):
            raise InvalidArgument("tools", f"[{i}]: function {name!r} is listed twice")
        out.append(Tool(name, params))
    return out


def tool_choice_mode(choice: Any, tools: list[Tool]) -> tuple[str, str | None]:
    """(none | auto | required | named, the named function)."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise InvalidArgument("tool_choice", f"{choice!r} needs tools")
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise InvalidArgument("tool_choice", "must be none, auto, required or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if not any(t.name == name for t in tools):
        raise InvalidArgument("tool_choice", f"function {name!r} is not among the tools")
    return "named", name


def tool_grammar(tools: list[Tool], mode: str, name: str | None,
                 parallel: bool) -> ResponseFormat | None:
    """The grammar that enforces a required or named tool choice."""
    if mode == "named":
        tool = next(t for t in tools if t.name == name)
        return ResponseFormat("json_schema", json.dumps(tool.parameters or ANY_OBJECT))
    if mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"enum": [t.name]},
                                               "arguments": t.parameters or ANY_OBJECT},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema: dict = {"type": "array", "minItems": 1,
                    "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return ResponseFormat("json_schema", json.dumps(schema))


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool turns as chat templates read them: an assistant turn that only calls tools has
    content "" (templates trim it), and each call's arguments are an object, not JSON text."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is not None:
            if m.get("role") != "assistant" or not isinstance(calls, list):
                raise InvalidArgument("messages", f"[{i}].tool_calls must be a list, on an "
                                      "assistant message")
            m = {**m, "tool_calls": [_template_call(i, c) for c in calls]}
            if m.get("content") is None:
                m["content"] = ""
        if m.get("role") == "tool" and not isinstance(m.get("tool_call_id", ""), str):
            raise InvalidArgument("messages", f"[{i}].tool_call_id must be a string")
        out.append(m)
    return out


def _template_call(i: int, call: Any) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidArgument("messages", f"[{i}].tool_calls: each needs function.name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise InvalidArgument("messages", f"[{i}].tool_calls: arguments of "
                                  f"{fn['name']!r} are not JSON") from None
    return {**call, "function": {**fn, "arguments": args}}


def template_kwargs(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise InvalidArgument("chat_template_kwargs", "must be an object")
    bad = sorted(set(value) & _RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise InvalidArgument("chat_template_kwargs", f"{bad[0]!r} is set by the server")
    return dict(value)


def output_spec(tok: Tokenizer, architecture: str, prompt: list[int], mode: str,
                name: str | None) -> ChatOutputSpec:
    template = getattr(tok.hf, "chat_template", None)
    template = template if isinstance(template, str) else None
    reasoning = uses_reasoning(template)
    in_reasoning = reasoning and tok.decode(
        prompt[-8:], skip_special_tokens=False).rstrip().endswith(THINK_START)
    family = detect_family(template, architecture) if mode == "auto" else None
    marker_id = tok.backend.token_to_id(MISTRAL_MARKER) if family == "mistral" else None
    return ChatOutputSpec(reasoning, in_reasoning, mode, family, name, marker_id,
                          MISTRAL_MARKER if marker_id is not None else "")
