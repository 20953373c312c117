"""Tool calls streamed while they are written: each call's name as soon as it is complete, then
its arguments as they grow, as OpenAI streams them:

    {"index": 0, "id": "call_…", "type": "function", "function": {"name": "f", "arguments": ""}}
    {"index": 0, "function": {"arguments": "{\"city\": \"Pa"}}
    {"index": 0, "function": {"arguments": "ris\"}"}}

The text a call is read from (held by the chat choice: the grammar's JSON for tool_choice
required or named, the model's own call syntax for auto) is scanned again on each new piece
for call objects {"name": ..., "arguments" | "parameters": {...}}, complete or not; what is
new since the last scan goes out. Arguments go out as the model wrote them (their text only
grows, so a piece never takes back one sent before).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.router_svc.tool_parsers import ToolCall, new_call_id

_ARGS_KEYS = ("arguments", "parameters")


@dataclass
class PartialCall:
    name: str | None = None  # None until its string is complete
    args: str = ""  # the arguments' text so far
    args_done: bool = False


def _skip_string(text: str, i: int) -> int | None:
    """The index after the JSON string starting at text[i] ('"'), or None if it is not
    complete yet."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def _skip_value(text: str, i: int) -> int | None:
    """The index after the JSON value starting at text[i], or None if it is not complete."""
    if text[i] == '"':
        return _skip_string(text, i)
    if text[i] in "{[":
        depth = 0
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _skip_string(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(text) else None


def _call_object(text: str, i: int) -> tuple[PartialCall, int | None]:
    """The call object starting at text[i] ('{'), and the index after it (None: not complete)."""
    call = PartialCall()
    i += 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text):
            return call, None
        if text[i] == "}":
            return call, i + 1
        if text[i] != '"':
            return call, None  # not JSON we can read: the end decides
        key_end = _skip_string(text, i)
        if key_end is None:
            return call, None
        key = text[i + 1:key_end - 1]
        i = key_end
        while i < len(text) and text[i] in " \t\r\n:":
            i += 1
        if i >= len(text):
            return call, None
        end = _skip_value(text, i)
        if key == "name" and text[i] == '"':
            if end is None:
                return call, None
            call.name = text[i + 1:end - 1]
        elif key in _ARGS_KEYS:
            call.args = text[i:end] if end is not None else text[i:]
            call.args_done = end is not None
        if end is None:
            return call, None
        i = end


def scan_calls(text: str) -> list[PartialCall]:
    """The call objects in `text`: top-level ones, and those of a top-level array."""
    calls: list[PartialCall] = []
    i, depth = 0, 0
    while i < len(text):
        c = text[i]
        if c == '"':
            end = _skip_string(text, i)
            if end is None:
                break
            i = end
            continue
        if c == "{" and depth <= 1:
            call, end = _call_object(text, i)
            calls.append(call)
            if end is None:
                break
            i = end
            continue
        if c == "[":
            depth += 1
        elif c == "]":
            depth = max(0, depth - 1)
        i += 1
    return calls


@dataclass
class ToolCallStreamer:
    """One choice's calls as OpenAI tool_call deltas. `named`: the held text is that
    function's arguments alone (tool_choice names it); `offered`: auto only streams calls to
    functions the request offered (any other is text, decided at the end)."""

    named: str | None = None
    offered: frozenset[str] | None = None
    sent: list[tuple[str, str, int]] = field(default_factory=list)  # (id, name, args sent)

    def update(self, held: str) -> list[dict]:
        calls = [PartialCall(self.named, held)] if self.named else scan_calls(held)
        out: list[dict] = []
        for k, c in enumerate(calls):
            if c.name is None or (self.offered is not None and c.name not in self.offered):
                break
            if k == len(self.sent):
                self.sent.append((new_call_id(), c.name, 0))
                out.append({"index": k, "id": self.sent[k][0], "type": "function",
                            "function": {"name": c.name, "arguments": ""}})
            call_id, name, n = self.sent[k]
            if len(c.args) > n:
                out.append({"index": k, "function": {"arguments": c.args[n:]}})
                self.sent[k] = (call_id, name, len(c.args))
        return out

    def calls(self, held: str) -> list[ToolCall]:
        """The calls streamed, as they ended (their arguments' whole text)."""
        scanned = [PartialCall(self.named, held)] if self.named else scan_calls(held)
        return [ToolCall(name, scanned[k].args if k < len(scanned) else "", call_id)
                for k, (call_id, name, _) in enumerate(self.sent)]
