"""Tool calls in a model's own syntax, parsed into OpenAI `tool_calls`.

Families (picked from the chat template, else the architecture):

    llama3_json  Llama 3.x:     {"name": "f", "parameters": {...}}  (several joined by ";"),
                                after an optional <|python_tag|>; the whole output is the call
    hermes       Qwen2.5/Qwen3: text <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
    mistral      Mistral:       text [TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]
                                or (v11+ tokenizers) [TOOL_CALLS]f[ARGS]{...} per call

Plus the form Tandem's own grammar writes for tool_choice "required" (a JSON array of
{"name", "arguments"} objects) and for a named function (its arguments object alone).

Streaming: text before a call streams as content; from where a call may start (its marker, or
a leading "{" for llama3_json) the text is held and parsed when the sample ends. Text that turns
out not to be a call is given back as content, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tandem.router_svc.reasoning import partial_tag_len

FAMILIES = ("llama3_json", "hermes", "mistral")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def openai(self, index: int | None = None) -> dict:
        d: dict[str, Any] = {"id": self.id or new_call_id(), "type": "function",
                             "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def detect_family(chat_template: str | None, architecture: str) -> str | None:
    """The tool-call syntax a model writes, from its chat template, else its architecture."""
    t = chat_template or ""
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json"
    arch = architecture.lower()
    for prefix, family in (("qwen", "hermes"), ("mistral", "mistral"), ("llama", "llama3_json")):
        if arch.startswith(prefix):
            return family
    return None


# -- one-shot parsers: text -> (content, calls); no call found -> (text, []) ---------------------
def _call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), new_call_id())


def _json_values(text: str) -> list[Any] | None:
    """Consecutive JSON values in `text` separated by whitespace, ',' or ';' (None if any part
    is not JSON)."""
    dec = json.JSONDecoder()
    out, i = [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i == len(text):
            return out
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)


def parse_llama3_json(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    values = _json_values(body)
    calls = [_call(v) for v in values or ()]
    if not calls or any(c is None for c in calls):
        return text, []
    return "", calls  # type: ignore[return-value]


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    if "<tool_call>" not in text:
        return text, []
    calls = []
    for m in _HERMES.finditer(text):
        values = _json_values(m.group(1).strip())
        if not values or len(values) != 1 or (call := _call(values[0])) is None:
            return text, []
        calls.append(call)
    content = _HERMES.sub("", text).strip()
    return content, calls


_MISTRAL_V11 = re.compile(r"([A-Za-z0-9_.\-]+)\[ARGS\]")


def parse_mistral(text: str) -> tuple[str, list[ToolCall]]:
    if "[TOOL_CALLS]" not in text:
        return text, []
    content, *parts = text.split("[TOOL_CALLS]")
    calls: list[ToolCall | None] = []
    for part in (p.strip() for p in parts):
        m = _MISTRAL_V11.match(part)
        if m:  # name[ARGS]{...}
            values = _json_values(part[m.end():])
            ok = values is not None and len(values) == 1
            calls.append(_call({"name": m.group(1), "arguments": values[0]}) if ok else None)
            continue
        values = _json_values(part) or [None]
        calls += [_call(x) for v in values for x in (v if isinstance(v, list) else [v])]
    if not calls or any(c is None for c in calls):
        return text, []
    return content.strip(), calls  # type: ignore[return-value]


PARSERS = {"llama3_json": parse_llama3_json, "hermes": parse_hermes, "mistral": parse_mistral}


def parse_required(text: str) -> list[ToolCall] | None:
    """tool_choice "required": the grammar wrote [{"name", "arguments"}, ...]."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    calls = [_call(v, ("arguments",)) for v in items] if isinstance(items, list) else [None]
    return None if not calls or any(c is None for c in calls) else calls  # type: ignore


def parse_named(name: str, text: str) -> list[ToolCall] | None:
    """A named tool_choice: the grammar wrote the function's arguments object."""
    try:
        args = json.loads(text)
    except ValueError:
        return None
    return [ToolCall(name, json.dumps(args, ensure_ascii=False), new_call_id())]


# -- streaming ---------------------------------------------------------------------------------
_MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}
PYTHON_TAG = "<|python_tag|>"


class StreamingToolParser:
    """Content deltas of one sample until a tool call may start; the rest at finish()."""

    def __init__(self, family: str) -> None:
        self.family = family
        self.marker = _MARKERS.get(family)
        self.text = ""  # everything fed
        self.sent = 0  # characters of `text` streamed as content
        self.holding = False  # a call may have started at `sent`: hold the rest
        self.held = ""  # at finish(): the text held since then

    def feed(self, delta: str) -> str:
        """The content this text makes safe to stream."""
        self.text += delta
        if self.holding:
            return ""
        if self.marker is None:  # llama3_json: a call is the whole output, starting with "{"
            head = self.text.lstrip()
            if not head or (self.sent == 0 and PYTHON_TAG.startswith(head)):
                return ""  # too early to tell
            if self.sent == 0 and (head.startswith("{") or head.startswith(PYTHON_TAG)):
                self.holding = True
                return ""
            return self._send(len(self.text))
        i = self.text.find(self.marker, self.sent)
        if i >= 0:
            self.holding = True
            return self._send(i)
        return self._send(len(self.text) - partial_tag_len(self.text, self.marker))

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content not streamed yet and the calls (none: the held text is content)."""
        self.held = self.text[self.sent:]
        self.sent = len(self.text)
        content, calls = PARSERS[self.family](self.held)
        return (content, calls) if calls else (self.held, [])

    def _send(self, end: int) -> str:
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out

