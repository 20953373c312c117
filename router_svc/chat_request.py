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

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from tandem.engine.grammar import check_strict
from tandem.engine.sampling_params import ResponseFormat
from tandem.engine.tokenizer import Tokenizer
from tandem.errors import InvalidArgument
from tandem.router_svc.chat_output import ChatOutputSpec
from tandem.router_svc.reasoning import START as THINK_START
from tandem.router_svc.reasoning import uses_reasoning
from tandem.router_svc.tool_parsers import detect_family

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
ANY_OBJECT = {"type": "object"}
# Keys the template call sets itself.
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "documents",
                                       "add_generation_prompt", "tokenize", "return_dict",
                                       "chat_template", "continue_final_message"})
MISTRAL_MARKER = "[TOOL_CALLS]"


def only_keys(value: dict, allowed: frozenset[str] | set[str], where: str) -> None:
    """No silently ignored field at any level: a key of `value` outside `allowed` is refused,
    named by its path (e.g. response_format.json_schema.foo)."""
    extra = next((k for k in value if k not in allowed), None)
    if extra is not None:
        raise InvalidArgument(f"{where}.{extra}", "is not supported by this server")


_FORMAT_KEYS = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"},
                "structural_tag": {"type", "format"}}
_JSON_SCHEMA_KEYS = frozenset({"name", "description", "schema", "strict"})


def response_format(value: Any, field: str = "response_format") -> ResponseFormat | None:
    """OpenAI's response_format: {"type": "text" | "json_object" | "json_schema", ...}, or
    xgrammar's structural tag {"type": "structural_tag", "format": {...}}. A strict json_schema
    must use only keywords the grammar enforces (engine/grammar.py); with strict false or
    unset, those it enforces are, and the others are not."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidArgument(field, "must be an object with a type")
    kind = value.get("type")
    if kind not in _FORMAT_KEYS:
        raise InvalidArgument(field, f"type must be text, json_object, json_schema or "
                              f"structural_tag, got {kind!r}")
    only_keys(value, _FORMAT_KEYS[kind], field)
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind == "structural_tag":
        if not isinstance(value.get("format"), dict):
            raise InvalidArgument(f"{field}.format", "must be an object (xgrammar's format)")
        return ResponseFormat("structural_tag", json.dumps(value))
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidArgument(field, "json_schema must be an object with a name and a schema")
    only_keys(spec, _JSON_SCHEMA_KEYS, f"{field}.json_schema")
    strict = spec.get("strict", False)
    if not isinstance(strict, bool) and strict is not None:
        raise InvalidArgument(f"{field}.json_schema.strict", "must be true or false")
    schema = spec.get("schema", ANY_OBJECT)
    if not isinstance(schema, dict | bool):
        raise InvalidArgument(field, "json_schema.schema must be a JSON Schema object")
    text = json.dumps(schema)
    if strict:
        check_strict(text, field)
    return ResponseFormat("json_schema", text)


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict | None


_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


def parse_tools(tools: Any) -> list[Tool]:
    """The function tools. A function with strict true must use only keywords the grammar
    enforces, which it does when tool_choice is required or names it (with auto, calls are read
    from the model's own text as written)."""
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
        only_keys(t, _TOOL_KEYS, f"tools[{i}]")
        only_keys(fn, _FUNCTION_KEYS, f"tools[{i}].function")
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
        if fn.get("strict") not in (None, True, False):
            raise InvalidArgument(f"tools[{i}].function.strict", "must be true or false")
        if fn.get("strict") and params is not None:
            check_strict(json.dumps(params), f"tools[{i}].function.parameters")
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
    if isinstance(fn, dict):
        only_keys(choice, {"type", "function"}, "tool_choice")
        only_keys(fn, {"name"}, "tool_choice.function")
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
    """Turns as chat templates read them: `developer` (OpenAI's instruction role, which
    templates do not know) is `system`; an assistant turn that only calls tools has content ""
    (templates trim it), and each call's arguments are an object, not JSON text."""
    out = []
    for i, m in enumerate(messages):
        if m.get("role") == "developer":
            m = {**m, "role": "system"}
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
                name: str | None, tools: list[Tool] = (), family: str | None = None
                ) -> ChatOutputSpec:
    """How the answer is read. `family`: the tool-call syntax, when the tools were shown by
    DEFAULT_TOOLS_PROMPT rather than the model's own template (else detected)."""
    template = getattr(tok.hf, "chat_template", None)
    template = template if isinstance(template, str) else None
    reasoning = uses_reasoning(template)
    in_reasoning = reasoning and tok.decode(
        prompt[-8:], skip_special_tokens=False).rstrip().endswith(THINK_START)
    if mode != "auto":
        family = None
    elif family is None:
        family = detect_family(template, architecture)
    marker_id = tok.backend.token_to_id(MISTRAL_MARKER) if family == "mistral" else None
    return ChatOutputSpec(reasoning, in_reasoning, mode, family, name, marker_id,
                          MISTRAL_MARKER if marker_id is not None else "",
                          frozenset(t.name for t in tools))


# -- tools for a template that cannot show them ---------------------------------------------------
_PROBE = "tandem_probe_function"


@functools.lru_cache(maxsize=16)
def template_shows_tools(tok: Tokenizer) -> bool:
    """Whether the model's chat template writes the tools it is given into the prompt (many,
    SmolLM2's among them, drop them without a word)."""
    probe = [{"type": "function", "function": {"name": _PROBE, "parameters": ANY_OBJECT}}]
    try:
        ids = tok.apply_chat_template([{"role": "user", "content": "x"}], tools=probe)
    except InvalidArgument:
        return False
    return _PROBE in tok.decode(ids, skip_special_tokens=False)


DEFAULT_TOOLS_FAMILY = "hermes"
DEFAULT_TOOLS_PROMPT = (
    "You may call functions. Their definitions (JSON Schema) are:\n{tools}\nTo call one, "
    "answer with <tool_call>{{\"name\": <the function's name>, \"arguments\": <an object of "
    "its arguments>}}</tool_call> (one such block per call) and nothing else.")


def with_default_tools(messages: list[dict[str, Any]], tools: list[dict]) -> list[dict[str, Any]]:
    """The conversation with the tools shown in plain text, for a template that cannot show
    them: DEFAULT_TOOLS_PROMPT at the end of the first system message (or as a system message
    of its own), earlier calls as <tool_call> blocks in their assistant turns, and tool results
    as user turns in <tool_response> blocks (as Qwen2.5's template writes them)."""
    prompt = DEFAULT_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t.get("function", t))
                                                         for t in tools))
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("tool_calls"):
            blocks = "".join(f"<tool_call>{json.dumps(c['function'])}</tool_call>"
                             for c in m["tool_calls"])
            m = {"role": "assistant", "content": (m.get("content") or "") + blocks}
        elif m.get("role") == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n"
                                            "</tool_response>"}
        out.append(m)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".lstrip()}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out
