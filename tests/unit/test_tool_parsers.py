"""Tool calls and reasoning read from fixed model texts of each family, whole and streamed in
chunks of every size: the same calls, content and reasoning either way."""

from __future__ import annotations

import json

import pytest

from tandem.router_svc.chat_output import ChatChoice, ChatOutputSpec
from tandem.router_svc.reasoning import ReasoningParser, split_reasoning
from tandem.router_svc.tool_parsers import (
    PARSERS,
    StreamingToolParser,
    detect_family,
    parse_named,
    parse_required,
)

WEATHER = {"city": "Paris", "unit": "c"}
TIME = {"zone": "utc"}

# (family, model text, expected content, expected [(name, arguments)])
CASES = [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}',
     "", [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
     '"unit": "c"}}; {"name": "get_time", "parameters": {"zone": "utc"}}',
     "", [("get_weather", WEATHER), ("get_time", TIME)]),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
     '"Paris", "unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
     '{"zone": "utc"}}\n</tool_call>', "Let me check.\n", [("get_weather", WEATHER),
                                                          ("get_time", TIME)]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>',
     "", [("get_time", TIME)]),
    ("hermes", "No tools needed: 4.", "No tools needed: 4.", []),
    ("hermes", "<tool_call>\n{broken json\n</tool_call>",
     "<tool_call>\n{broken json\n</tool_call>", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "c"}}, {"name": "get_time", "arguments": {"zone": "utc"}}]', "",
     [("get_weather", WEATHER), ("get_time", TIME)]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}'
     '[TOOL_CALLS]get_time[ARGS]{"zone": "utc"}', "", [("get_weather", WEATHER),
                                                        ("get_time", TIME)]),
    ("mistral", "Bonjour.", "Bonjour.", []),
]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("family", "text", "content", "calls"), CASES)
def test_parsers_whole_and_streamed(family, text, content, calls):
    got_content, got_calls = PARSERS[family](text)
    assert _calls(got_calls) == calls
    if calls:
        assert got_content.strip() == content.strip()
        assert all(c.id.startswith("call_") for c in got_calls)
    else:
        assert got_content == text
    for size in (1, 2, 3, 7, len(text)):
        p = StreamingToolParser(family)
        streamed = "".join(p.feed(text[i:i + size]) for i in range(0, len(text), size))
        rest, s_calls = p.finish()
        assert _calls(s_calls) == calls
        assert streamed + rest == (content if calls else text)
        if calls and p.marker:  # nothing of a call leaks into streamed content
            assert p.marker not in streamed


def _streamed_calls(spec: ChatOutputSpec, text: str, size: int) -> tuple[list, list, str]:
    """Feed `text` in pieces of `size` through a choice: (the calls the deltas build, in
    order, the deltas, the content streamed)."""
    choice = ChatChoice(spec)
    deltas, content = [], ""
    for i in range(0, len(text), size):
        md = choice.feed(text[i:i + size], [])
        deltas += md.call_deltas
        content += md.content
    end = choice.finish()
    deltas += end.call_deltas
    content += end.content
    built: dict[int, list[str]] = {}
    for d in deltas:
        fn = d["function"]
        if "name" in fn:
            built[d["index"]] = [fn["name"], fn["arguments"]]
        else:
            built[d["index"]][1] += fn["arguments"]
    return [(name, json.loads(args)) for name, args in built.values()], deltas, content


@pytest.mark.parametrize(("family", "text", "content", "calls"),
                         [c for c in CASES if c[3]])
def test_auto_calls_stream_their_arguments_as_written(family, text, content, calls):
    spec = ChatOutputSpec(tool_mode="auto", tool_family=family)
    for size in (1, 4, len(text)):
        got, deltas, streamed = _streamed_calls(spec, text, size)
        assert got == calls and streamed.strip() == content.strip()
        if size == 1 and "[ARGS]" not in text:  # pieces while written (not only at the end)
            assert len(deltas) > 2 * len(calls)


def test_text_after_a_streamed_call_is_kept():
    """The text a model writes after its calls is content, as it is when nothing streams."""
    text = ('Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}'
            '\n</tool_call>\nDone.')
    whole = StreamingToolParser("hermes")
    expected = whole.feed(text) + whole.finish()[0]
    for size in (1, 4, len(text)):
        got, _, content = _streamed_calls(
            ChatOutputSpec(tool_mode="auto", tool_family="hermes"), text, size)
        assert got == [("get_time", TIME)] and content == expected


def test_required_and_named_calls_stream_as_the_grammar_writes_them():
    required = ('[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
                '{"name": "get_time", "arguments": {"zone": "utc"}}]')
    for size in (1, 3, len(required)):
        got, deltas, content = _streamed_calls(ChatOutputSpec(tool_mode="required"),
                                               required, size)
        assert got == [("get_weather", WEATHER), ("get_time", TIME)] and content == ""
    got, deltas, _ = _streamed_calls(ChatOutputSpec(tool_mode="named", tool_name="get_time"),
                                     '{"zone": "utc"}', 2)
    assert got == [("get_time", TIME)] and len(deltas) > 3
    # auto: a call to a function not offered is never streamed; it ends as text.
    spec = ChatOutputSpec(tool_mode="auto", tool_family="llama3_json",
                          tool_names=frozenset({"get_time"}))
    text = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
    got, deltas, content = _streamed_calls(spec, text, 3)
    assert got == [] and deltas == [] and content == text


def test_required_and_named_forms():
    calls = parse_required('[{"name": "get_time", "arguments": {"zone": "utc"}}]')
    assert _calls(calls) == [("get_time", TIME)]
    assert parse_required('[{"name": "get_time", "arguments": {"zone": "u') is None  # cut off
    assert parse_required("[]") is None
    assert _calls(parse_named("get_time", '{"zone": "utc"}')) == [("get_time", TIME)]
    assert parse_named("get_time", '{"zone": ') is None


def test_family_from_template_then_architecture():
    assert detect_family("...<tool_call>...", "LlamaForCausalLM") == "hermes"
    assert detect_family("...[TOOL_CALLS]...", "LlamaForCausalLM") == "mistral"
    assert detect_family("<|python_tag|>", "Qwen2ForCausalLM") == "llama3_json"
    assert detect_family(None, "Qwen3ForCausalLM") == "hermes"
    assert detect_family("", "MistralForCausalLM") == "mistral"
    assert detect_family("", "LlamaForCausalLM") == "llama3_json"
    assert detect_family("", "GPT2LMHeadModel") is None


THINK = "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4."


@pytest.mark.parametrize(("text", "in_reasoning", "reasoning", "content"), [
    (THINK, False, "\nThe user wants 2+2.\n", "It is 4."),
    ("The user wants 2+2.</think>It is 4.", True, "The user wants 2+2.", "It is 4."),
    ("It is 4.", False, None, "It is 4."),
    ("<think>still thinking", False, "still thinking", ""),  # cut by max_tokens
    ("<thin", False, None, "<thin"),  # not a tag after all
    ("a < b </think", False, None, "a < b </think"),
])
def test_reasoning_split_whole_and_streamed(text, in_reasoning, reasoning, content):
    assert split_reasoning(text, in_reasoning) == (reasoning, content)
    for size in (1, 2, 5, len(text)):
        p = ReasoningParser(in_reasoning)
        parts = [p.feed(text[i:i + size]) for i in range(0, len(text), size)] + [p.finish()]
        assert "".join(r for r, _ in parts) == (reasoning or "")
        assert "".join(c for _, c in parts) == content


def test_chat_choice_reasoning_then_tool_call_streamed():
    text = ('<think>\nNeed the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>')
    choice = ChatChoice(ChatOutputSpec(reasoning=True, tool_mode="auto", tool_family="hermes"))
    deltas = [choice.feed(text[i:i + 4], []) for i in range(0, len(text), 4)]
    end = choice.finish()
    assert "".join(d.reasoning for d in deltas) + end.reasoning == "\nNeed the weather.\n"
    assert "".join(d.content for d in deltas) + end.content == ""
    assert _calls(end.tool_calls) == [("get_weather", WEATHER)]
    msg = choice.message()
    assert msg["content"] is None and msg["reasoning_content"] == "\nNeed the weather.\n"
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather"


def test_chat_choice_mistral_marker_token_restored():
    """[TOOL_CALLS] is a special token the detokenizer skips: its id brings it back."""
    spec = ChatOutputSpec(tool_mode="auto", tool_family="mistral", marker_id=5,
                          marker_text="[TOOL_CALLS]")
    choice = ChatChoice(spec)
    assert choice.feed("", [5]).content == ""
    choice.feed('[{"name": "get_time", "arguments": {"zone": "utc"}}]', [9, 9])
    assert _calls(choice.finish().tool_calls) == [("get_time", TIME)]


def test_chat_shaper_streams_reasoning_content_and_tool_calls():
    from tandem.router_svc.frontend import Delta, Usage
    from tandem.router_svc.openai_objects import ChatShaper

    text = ('<think>hmm</think>\n\nSure.<tool_call>\n{"name": "get_time", "arguments": '
            '{"zone": "utc"}}\n</tool_call>')
    spec = ChatOutputSpec(reasoning=True, tool_mode="auto", tool_family="hermes")
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    for stream in (True, False):
        shaper = ChatShaper(None, "chatcmpl-x", "m", 1, False, stream, False, output=spec)
        chunks = shaper.start() if stream else []
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            chunks += shaper.add(([Delta(0, [1], piece, [None], "stop" if last else None)],
                                  Usage(3, k + 1)))
        final = shaper.final()["choices"][0]
        assert final["finish_reason"] == "tool_calls"
        msg = final["message"]
        assert msg["reasoning_content"] == "hmm" and msg["content"] == "Sure."
        assert _calls_of(msg["tool_calls"]) == [("get_time", TIME)]
        if not stream:
            assert chunks == []
            continue
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "hmm"
        assert "".join(d.get("content", "") for d in deltas[1:]) == "Sure."
        calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
        # The name first, then the arguments in pieces as they were written.
        assert {tc["index"] for tc in calls} == {0} and len(calls) > 2
        assert calls[0]["id"] == msg["tool_calls"][0]["id"]
        assert calls[0]["function"] == {"name": "get_time", "arguments": ""}
        assert all("id" not in tc and "name" not in tc["function"] for tc in calls[1:])
        assert json.loads("".join(tc["function"]["arguments"] for tc in calls)) == TIME
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def _calls_of(tool_calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls]
