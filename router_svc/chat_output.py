"""One chat choice's text turned into an OpenAI message: reasoning split off first, then tool
calls, as the text streams.

    text ─▶ ReasoningParser ─▶ reasoning_content deltas
                            └▶ content ─▶ tool mode none:      content deltas
                                          auto:                StreamingToolParser (model syntax)
                                          required / named:    held: the grammar's JSON
                                          held calls ─▶ ToolCallStreamer: name, then
                                                        arguments deltas as they are written
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.router_svc.reasoning import ReasoningParser
from tandem.router_svc.tool_parsers import (
    StreamingToolParser,
    ToolCall,
    parse_named,
    parse_required,
)
from tandem.router_svc.tool_stream import ToolCallStreamer


@dataclass(frozen=True)
class ChatOutputSpec:
    """How a request's choices are read; the same for each of its n choices."""

    reasoning: bool = False  # the model thinks in <think> blocks
    in_reasoning: bool = False  # the prompt ends inside an open <think>
    tool_mode: str = "none"  # none | auto | required | named
    tool_family: str | None = None  # auto: the model's tool-call syntax
    tool_name: str | None = None  # named
    marker_id: int | None = None  # a tool-call marker token that decodes to nothing
    marker_text: str = ""
    # auto: the functions offered; a call to any other is text, not a call (None: unchecked)
    tool_names: frozenset[str] | None = None


@dataclass
class MessageDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)  # at the end: every call
    call_deltas: list[dict] = field(default_factory=list)  # OpenAI tool_call deltas to stream


class ChatChoice:
    def __init__(self, spec: ChatOutputSpec) -> None:
        self.spec = spec
        self.reasoner = ReasoningParser(spec.in_reasoning) if spec.reasoning else None
        self.tools = (StreamingToolParser(spec.tool_family)
                      if spec.tool_mode == "auto" and spec.tool_family else None)
        self.streamer = (ToolCallStreamer(spec.tool_name if spec.tool_mode == "named" else None,
                                          spec.tool_names if self.tools is not None else None)
                         if self.tools is not None or spec.tool_mode in ("required", "named")
                         else None)
        self.held = ""  # required / named: the grammar's JSON, read at the end
        self.content = ""
        self.reasoning: str | None = "" if spec.in_reasoning else None
        self.tool_calls: list[ToolCall] = []

    def feed(self, text: str, token_ids: list[int]) -> MessageDelta:
        s = self.spec
        if s.marker_id is not None and s.marker_id in token_ids and s.marker_text not in text:
            text = s.marker_text + text  # a special token the detokenizer skipped
        delta = self._record(*self._split(text, final=False))
        if self.streamer is not None:
            delta.call_deltas = self.streamer.update(self._held_text())
        return delta

    def _held_text(self) -> str:
        """The text calls are read from: the grammar's JSON, or the model's text from where a
        call may have started."""
        if self.tools is not None:
            return self.tools.text[self.tools.sent:] if self.tools.holding else ""
        return self.held

    def finish(self) -> MessageDelta:
        """At the sample's end: what was held, and the tool calls (what of them was not
        streamed yet goes in call_deltas)."""
        held = self._held_text()
        reasoning, content = self._split("", final=True)
        calls: list[ToolCall] = []
        streamed = self.streamer is not None and bool(self.streamer.sent)
        if self.tools is not None:
            rest, calls = self.tools.finish()
            names = self.spec.tool_names
            if names is not None and any(c.name not in names for c in calls):
                # Not a call of ours (a JSON answer read as one): the text, as written.
                rest, calls = self.tools.held, []
            # Streamed calls stand. When the whole text reads as calls too, `rest` is the text
            # after them; when it does not, `rest` is the text the calls were streamed from.
            content += rest if calls or not streamed else ""
        elif self.spec.tool_mode in ("required", "named"):
            parsed = (parse_required(self.held) if self.spec.tool_mode == "required"
                      else parse_named(self.spec.tool_name or "", self.held))
            if parsed is None and not streamed:  # cut short (length): what was written is all
                content += self.held
            else:
                calls = parsed or []
        delta = self._record(reasoning, content)
        if streamed:  # the calls as they were streamed, their arguments' last pieces
            delta.call_deltas = self.streamer.update(held)
            calls = self.streamer.calls(held)
        else:
            delta.call_deltas = [c.openai(k) for k, c in enumerate(calls)]
        self.tool_calls = delta.tool_calls = calls
        return delta

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        if self.reasoner is None:
            reasoning, content = "", text
        elif final:
            reasoning, content = self.reasoner.finish()
        else:
            reasoning, content = self.reasoner.feed(text)
        if self.reasoner is not None and self.reasoner.thought and self.reasoning is None:
            self.reasoning = ""
        if self.tools is not None:
            content = self.tools.feed(content)
        elif self.spec.tool_mode in ("required", "named"):
            self.held += content
            content = ""
        return reasoning, content

    def _record(self, reasoning: str, content: str) -> MessageDelta:
        if reasoning:
            self.reasoning = (self.reasoning or "") + reasoning
        self.content += content
        return MessageDelta(content, reasoning)

    def message(self) -> dict:
        msg: dict = {"role": "assistant",
                     "content": self.content if self.content or not self.tool_calls else None}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [c.openai() for c in self.tool_calls]
        return msg
