"""OpenAI's Responses API (POST /v1/responses, GET /v1/responses/{id}) over the chat path:

    ResponsesRequest ─▶ chat messages (instructions first, the stored conversation of
    previous_response_id, then input items) and a ChatCompletionRequest ─▶ chat_plan ─▶
    Frontend.stream ─▶ ResponsesShaper: output items (reasoning, message, function_call) and,
    streaming, the API's events (response.created ... response.completed)

Served: text and function-tool turns (function_call items in the output; function_call and
function_call_output items in the input), instructions, text.format (text, json_object,
json_schema), temperature, top_p, max_output_tokens, parallel_tool_calls, tool_choice, the
sampling extras of the chat endpoint, and previous_response_id over a bounded in-memory store
(--responses-store responses, least recently used dropped first; each tenant sees only its
own). Not served, refused with a 400 naming the field: any other field (reasoning, include,
background, conversation, prompt, top_logprobs, ...), tools other than functions, input items
other than messages and function calls (images, files), truncation "auto", n.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, create_model

from tandem.errors import InvalidArgument
from tandem.router_svc import openai_requests as req
from tandem.router_svc.chat_output import ChatChoice
from tandem.router_svc.chat_request import only_keys
from tandem.router_svc.frontend import Delta, Usage
from tandem.router_svc.http_errors import ApiError
from tandem.router_svc.openai_objects import Shaper, Step

DEFAULT_STORE = 1024  # responses kept for previous_response_id

# Chat names -> the Responses API's, for errors.
NAMES = {"prompt": "input", "messages": "input", "max_tokens": "max_output_tokens",
         "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


class _Declared(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    text: dict[str, Any] | None = None
    truncation: str | None = None


# The chat endpoint's sampling fields of the same name (temperature, top_p, seed, top_k, ...),
# but n (one output per response) and prompt_logprobs (a response has no place for them):
# those two are refused as unknown fields.
_SAMPLING = tuple(n for n in req.DERIVED_FIELDS if n not in ("n", "prompt_logprobs"))
ResponsesRequest = create_model(  # type: ignore[call-overload]
    "ResponsesRequest", __base__=_Declared,
    **{n: (f.annotation, None) for n, f in req.CompletionRequest.model_fields.items()
       if n in _SAMPLING})


# -- the store -----------------------------------------------------------------------------------
@dataclass
class Stored:
    tenant: str
    conversation: list[dict[str, Any]]  # chat messages: earlier turns, this input, its output
    response: dict[str, Any]


class ResponseStore:
    """Responses kept for previous_response_id and GET, at most `capacity` (least recently used
    dropped first); a tenant (API key) sees only its own."""

    def __init__(self, capacity: int = DEFAULT_STORE) -> None:
        if capacity < 0:
            raise InvalidArgument("--responses-store", f"must be >= 0, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str, tenant: str) -> Stored | None:
        item = self._items.get(response_id)
        if item is None or item.tenant != tenant:
            return None
        self._items.move_to_end(response_id)
        return item

    def put(self, response_id: str, item: Stored) -> None:
        if self.capacity == 0:
            return
        self._items[response_id] = item
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


# -- request -> chat ----------------------------------------------------------------------------
_MESSAGE_KEYS = {"type", "role", "content", "id", "status"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidArgument(where, "must be text or a list of text parts")
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidArgument(f"{where}[{j}].type", f"{kind!r} is not supported (text "
                                  "parts only)")
        only_keys(part, {"type", "text", "annotations", "logprobs"}, f"{where}[{j}]")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as chat messages: messages as they are; function calls (one assistant turn
    for those in a row) and their outputs (tool turns); reasoning items dropped, as chat
    templates drop earlier reasoning."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            only_keys(item, _MESSAGE_KEYS, where)
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidArgument(f"{where}.role", f"{role!r} is not a message role")
            out.append({"role": role, "content": _content(item.get("content"),
                                                          f"{where}.content")})
        elif kind == "function_call":
            only_keys(item, {"type", "call_id", "name", "arguments", "id", "status"}, where)
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") \
                    and not last["content"]:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            only_keys(item, {"type", "call_id", "output", "id", "status"}, where)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": _content(item.get("output", ""), f"{where}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise InvalidArgument(f"{where}.type", f"{kind!r} is not supported")
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise InvalidArgument(f"tools[{i}].type", f"{t.get('type')!r} is not supported "
                                  "(function tools only)")
        only_keys(t, {"type", "name", "description", "parameters", "strict"}, f"tools[{i}]")
        out.append({"type": "function", "function": {k: v for k, v in t.items()
                                                     if k != "type"}})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        only_keys(choice, {"type", "name"}, "tool_choice")
        if choice.get("type") != "function":
            raise InvalidArgument("tool_choice.type", "must be function")
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def chat_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format as chat's response_format."""
    if text is None:
        return None
    only_keys(text, {"format"}, "text")
    fmt = text.get("format")
    if fmt is None or not isinstance(fmt, dict):
        return None
    if fmt.get("type") == "json_schema":
        only_keys(fmt, {"type", "name", "schema", "strict", "description"}, "text.format")
        return {"type": "json_schema",
                "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return fmt


def chat_request(body: Any, conversation: list[dict[str, Any]]) -> req.ChatCompletionRequest:
    """The ChatCompletionRequest this response runs as."""
    if body.truncation not in (None, "disabled"):
        raise InvalidArgument("truncation", "only \"disabled\" is supported")
    messages = list(conversation)
    if body.instructions is not None:  # never carried over from a previous response
        messages.insert(0, {"role": "system", "content": body.instructions})
    fields = {"model": body.model, "messages": messages, "stream": False,
              "tools": chat_tools(body.tools), "tool_choice": chat_tool_choice(body.tool_choice),
              "parallel_tool_calls": body.parallel_tool_calls,
              "max_completion_tokens": body.max_output_tokens,
              "response_format": chat_format(body.text),
              **{n: v for n in _SAMPLING if (v := getattr(body, n)) is not None}}
    return req.ChatCompletionRequest.model_validate(
        {k: v for k, v in fields.items() if v is not None})


# -- chat output -> response ---------------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Item:
    """One output item as it is built: reasoning, message or function_call."""

    kind: str
    id: str
    text: str = ""  # reasoning / message text, or a call's arguments
    name: str = ""  # function_call
    call_id: str = ""
    done: bool = False

    def json(self, status: str = "completed") -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "reasoning", "id": self.id, "summary": [],
                    "content": [{"type": "reasoning_text", "text": self.text}]}
        if self.kind == "message":
            return {"type": "message", "id": self.id, "status": status, "role": "assistant",
                    "content": [_text_part(self.text)] if self.done or self.text else []}
        return {"type": "function_call", "id": self.id, "call_id": self.call_id,
                "name": self.name, "arguments": self.text, "status": status}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponsesShaper(Shaper):
    """Frontend steps as one response: its output items and, streaming, its events. `on_done`
    gets the finished response object and the conversation's messages after it (to store)."""

    def __init__(self, tok: Any, id_: str, model: str, stream: bool, plan: req.ChatPlan,
                 echo: dict[str, Any], on_done: Any = None) -> None:
        self.id, self.model, self.stream = id_, model, stream
        self.created = int(time.time())
        self.usage = Usage()
        self.choice = ChatChoice(plan.output)
        self.echo = echo  # request fields the response object repeats
        self.on_done = on_done
        self.items: list[_Item] = []
        self.seq = 0
        self.status = "in_progress"
        self.incomplete: dict[str, str] | None = None

    # -- events ----------------------------------------------------------------------------
    @staticmethod
    def sse(obj: dict | str) -> str:
        assert isinstance(obj, dict)
        return f"event: {obj['type']}\ndata: {json.dumps(obj)}\n\n"

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def end(self) -> list[dict | str]:
        return []  # response.completed came with the last step

    def failed(self, error: ApiError, ended: bool = False) -> list[dict | str]:
        self.status = "failed"
        return [self._event("error", code=error.code, message=error.message,
                            param=error.param)]

    # -- steps -------------------------------------------------------------------------------
    def add(self, step: Step) -> list[dict]:
        deltas, self.usage = step
        events: list[dict] = []
        for d in deltas:
            events += self._delta(d)
        return events if self.stream else []

    def _delta(self, d: Delta) -> list[dict]:
        md = self.choice.feed(d.text, d.token_ids)
        events = self._grow(md.reasoning, md.content, md.call_deltas)
        if d.finish_reason is not None:
            end = self.choice.finish()
            events += self._grow(end.reasoning, end.content, end.call_deltas)
            for item in self.items:
                events += self._close(item)
            if d.finish_reason == "length":
                self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
            else:
                self.status = "completed"
            response = self.response()
            if self.on_done is not None:
                self.on_done(response)
            kind = "response.completed" if self.status == "completed" else "response.incomplete"
            events.append(self._event(kind, response=response))
        return events

    def _grow(self, reasoning: str, content: str, calls: list[dict]) -> list[dict]:
        events = []
        if reasoning:
            item, opened = self._open("reasoning")
            events += opened
            item.text += reasoning
            events.append(self._event("response.reasoning_text.delta", item_id=item.id,
                                      output_index=self.items.index(item), content_index=0,
                                      delta=reasoning))
        if content:
            item, opened = self._open("message")
            events += opened
            item.text += content
            events.append(self._event("response.output_text.delta", item_id=item.id,
                                      output_index=self.items.index(item), content_index=0,
                                      delta=content, logprobs=[]))
        for c in calls:
            if "id" in c:  # a new call
                item, opened = self._open("function_call", c)
                events += opened
            else:
                item = [i for i in self.items if i.kind == "function_call"][c["index"]]
            piece = c["function"].get("arguments", "")
            if piece:
                item.text += piece
                events.append(self._event("response.function_call_arguments.delta",
                                          item_id=item.id, output_index=self.items.index(item),
                                          delta=piece))
        return events

    def _open(self, kind: str, call: dict | None = None) -> tuple[_Item, list[dict]]:
        """The open item of `kind` (a new call's always new), opening it after closing the
        others: output items come one after another."""
        last = self.items[-1] if self.items else None
        if call is None and last is not None and last.kind == kind and not last.done:
            return last, []
        events = [e for item in self.items for e in self._close(item)]
        item = _Item(kind, _new_id({"reasoning": "rs", "message": "msg"}.get(kind, "fc")))
        if call is not None:
            item.name, item.call_id = call["function"]["name"], call["id"]
        self.items.append(item)
        index = len(self.items) - 1
        events.append(self._event("response.output_item.added", output_index=index,
                                  item=item.json("in_progress")))
        if kind == "message":
            events.append(self._event("response.content_part.added", item_id=item.id,
                                      output_index=index, content_index=0,
                                      part=_text_part("")))
        return item, events

    def _close(self, item: _Item) -> list[dict]:
        if item.done:
            return []
        item.done = True
        index = self.items.index(item)
        events = []
        if item.kind == "reasoning":
            events.append(self._event("response.reasoning_text.done", item_id=item.id,
                                      output_index=index, content_index=0, text=item.text))
        elif item.kind == "message":
            events += [self._event("response.output_text.done", item_id=item.id,
                                   output_index=index, content_index=0, text=item.text,
                                   logprobs=[]),
                       self._event("response.content_part.done", item_id=item.id,
                                   output_index=index, content_index=0,
                                   part=_text_part(item.text))]
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item.id,
                                      output_index=index, name=item.name,
                                      arguments=item.text))
        events.append(self._event("response.output_item.done", output_index=index,
                                  item=item.json()))
        return events

    # -- the response object ---------------------------------------------------------------
    def response(self) -> dict[str, Any]:
        u = self.usage
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": self.status, "model": self.model, "error": None,
                "incomplete_details": self.incomplete,
                "output": [i.json() for i in self.items] if self.status != "in_progress" else [],
                "usage": None if self.status == "in_progress" else {
                    "input_tokens": u.prompt_tokens,
                    "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
                    "output_tokens": u.completion_tokens,
                    "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": u.prompt_tokens + u.completion_tokens},
                **self.echo}

    def final(self) -> dict:
        return self.response()


def output_messages(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A response's output as chat messages (for the next turn): the message's text and its
    function calls as one assistant turn; reasoning dropped."""
    content, calls = "", []
    for item in response["output"]:
        if item["type"] == "message":
            content += "".join(p["text"] for p in item["content"])
        elif item["type"] == "function_call":
            calls.append({"id": item["call_id"], "type": "function",
                          "function": {"name": item["name"], "arguments": item["arguments"]}})
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
    return [msg]


def echo_fields(body: Any) -> dict[str, Any]:
    """The request's settings a response object repeats."""
    return {"instructions": body.instructions, "previous_response_id": body.previous_response_id,
            "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": body.temperature, "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens, "store": body.store,
            "text": body.text or {"format": {"type": "text"}}, "truncation": "disabled",
            "metadata": (body.model_extra or {}).get("metadata") or {},
            "reasoning": {"effort": None, "summary": None}}


def not_found(response_id: str) -> ApiError:
    return ApiError(404, f"no response with id {response_id!r} is stored here (it may have "
                    "been dropped: the store keeps the most recent --responses-store)",
                    param="response_id", code="not_found")

