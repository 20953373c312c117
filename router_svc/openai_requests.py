"""The OpenAI request bodies (pydantic) and what the HTTP API makes of them: prompt ids, the
SamplingParams, and for chat the template's input and how the answer is read back. Errors are
InvalidArgument naming the OpenAI field.

No field is silently ignored: a field these models do not declare is refused by name
(unknown_field) unless it cannot change the answer (HARMLESS_FIELDS).
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, create_model

from tandem.engine.sampling_params import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_ENTRIES,
    SAME,
    ResponseFormat,
    SamplingParams,
    param_spec,
    request_params,
)
from tandem.errors import InvalidArgument
from tandem.router_svc import chat_request, prompt_batch
from tandem.router_svc.chat_output import ChatOutputSpec
from tandem.router_svc.frontend import Frontend
from tandem.router_svc.json_body import MAX_TOTAL_ITEMS, BodyLimits
from tandem.router_svc.reasoning import END as THINK_END


# Strict types throughout: "yes" is not a bool and true is not a number (pydantic would coerce).
class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk
    include_obfuscation: bool = False  # OpenAI's: a random-length `obfuscation` in each chunk


MAX_MESSAGES = 4096
MAX_TOOLS = 128  # OpenAI's documented limit on a request's tools


def body_limits(max_model_len: int) -> BodyLimits:
    """How many items the fields below may hold, checked while a body is scanned, before it is
    parsed (json_body.py): a body past a limit costs no more than its first items and is a 400
    naming the field. Token ids: no more than the model takes in all."""
    ids = max_model_len
    return BodyLimits(fields={"prompt": ids, "prompt[]": ids, "tokens": ids,
                              "messages": MAX_MESSAGES, "tools": MAX_TOOLS,
                              "stop": MAX_STOP_ENTRIES, "stop_token_ids": MAX_STOP_ENTRIES,
                              "logit_bias": MAX_LOGIT_BIAS_ENTRIES},
                      total=ids + MAX_TOTAL_ITEMS)


# Fields accepted and not acted on: none of them changes what the model writes.
HARMLESS_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier",
                             "prompt_cache_key"})


# The request parameters OpenAI spells its own way, mapped by hand below: engine field -> the
# OpenAI fields that set it. Every other parameter of SamplingParams is an OpenAI field of its
# own name and type, derived (_derived_fields); tests/unit/test_params_seam.py holds the two sets
# equal to the declaration's.
MAPPED_FIELDS = {
    "max_tokens": ("max_tokens", "max_completion_tokens"),
    "top_k": ("top_k",),  # vLLM spells "off" -1
    "stop": ("stop",),  # one string or a list
    "logprobs": ("logprobs", "top_logprobs"),  # completions: a count; chat: a flag and a count
    "logit_bias": ("logit_bias",),  # keys are token ids as strings
    "response_format": ("response_format", "structured_outputs", "guided_json", "guided_regex",
                        "guided_choice", "guided_grammar"),
}


class _MappedFields(BaseModel):
    """Fields both endpoints share, declared by hand. Any other field is refused by name (see
    _refuse_unknown) unless it is one of HARMLESS_FIELDS."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's spellings of a structured output (request_format)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


def _derived_fields() -> dict[str, Any]:
    """One optional field per request parameter that OpenAI (or vLLM's extras) names as the
    engine does; unset (None) leaves the engine's default."""
    hints = typing.get_type_hints(SamplingParams)
    out: dict[str, Any] = {}
    for f in request_params():
        if param_spec(f).openai != SAME:
            continue
        hint = hints[f.name]
        if typing.get_origin(hint) is tuple:  # a JSON array
            hint = list[typing.get_args(hint)[0]]  # type: ignore[misc]
        out[f.name] = (hint | None, None)
    return out


DERIVED_FIELDS = tuple(_derived_fields())
_SamplingFields = create_model("_SamplingFields", __base__=_MappedFields,  # type: ignore[call-overload]
                               **_derived_fields())


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    functions: Any = None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or messages rendered with the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]


def refuse(cond: object, param: str, message: str) -> None:
    if cond:
        raise InvalidArgument(param, message)


def unknown_field(req: BaseModel) -> str | None:
    """The first field of the request that is neither declared nor harmless."""
    return next((k for k in req.model_extra or {} if k not in HARMLESS_FIELDS), None)


# vLLM's spellings of a structured output beside OpenAI's response_format (one per request):
# structured_outputs {json | regex | choice | grammar | structural_tag | json_object: ...},
# and the older guided_json, guided_regex, guided_choice, guided_grammar.
_STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                     "grammar": "grammar", "structural_tag": "structural_tag",
                     "json_object": "json_object"}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def format_field(req: Any) -> str:
    """The field that gave the request's structured output (its errors are named so)."""
    return next((name for name in _FORMAT_FIELDS if getattr(req, name) is not None),
                "response_format")


_FORMAT_FIELDS = ("response_format", "structured_outputs", *_GUIDED)


def request_format(req: Any) -> ResponseFormat | None:
    """The request's structured output, from whichever one field names it."""
    given = [name for name in _FORMAT_FIELDS if getattr(req, name) is not None]
    refuse(len(given) > 1, given[-1] if given else "", f"give one of {', '.join(given)}")
    if not given:
        return None
    name = given[0]
    if name == "response_format":
        return chat_request.response_format(req.response_format)
    if name == "structured_outputs":
        spec = req.structured_outputs
        chat_request.only_keys(spec, set(_STRUCTURED_KINDS), name)
        refuse(len(spec) != 1, name, f"give exactly one of {', '.join(_STRUCTURED_KINDS)}")
        key, value = next(iter(spec.items()))
        return structured_format(_STRUCTURED_KINDS[key], value, f"{name}.{key}")
    return structured_format(_STRUCTURED_KINDS[_GUIDED[name]], getattr(req, name), name)


def structured_format(kind: str, value: Any, field: str) -> ResponseFormat | None:
    """A format of `kind` from its value as vLLM's fields give it (a schema as an object or
    JSON text, a regex, a list of choices, a grammar's text, a structural tag)."""
    if kind == "json_object":
        refuse(value is not True, field, "set it to true, or leave it out")
        return ResponseFormat("json_object")
    if kind in ("json_schema", "structural_tag") and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise InvalidArgument(field, "is not JSON") from None
    if kind == "json_schema":
        return chat_request.response_format({"type": "json_schema",
                                             "json_schema": {"schema": value}}, field)
    if kind == "structural_tag":
        return chat_request.response_format(value, field)
    if kind == "choice":
        refuse(not isinstance(value, list), field, "must be a list of strings")
        value = json.dumps(value)
    refuse(not isinstance(value, str), field, "must be a string")
    try:
        return ResponseFormat(kind, value)
    except InvalidArgument as e:
        raise InvalidArgument(field, e.message) from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    try:
        return {int(k): v for k, v in (bias or {}).items()}
    except ValueError:
        raise InvalidArgument("logit_bias", "keys must be token ids") from None


def sampling_params(req: Any, max_tokens: int | None, logprobs: int | None,
                    response_format: ResponseFormat | None = None) -> SamplingParams:
    """The SamplingParams of an OpenAI request: the derived fields as they are, the mapped ones
    as given here (max_tokens None: the engine's default)."""
    refuse(req.stream_options is not None and not req.stream, "stream_options",
           "is only allowed with stream=true")
    kw: dict[str, Any] = {name: v for name in DERIVED_FIELDS
                          if (v := getattr(req, name)) is not None}
    if req.top_k is not None:
        kw["top_k"] = 0 if req.top_k == -1 else req.top_k  # vLLM spells "off" -1
    if max_tokens is not None:
        kw["max_tokens"] = max_tokens
    return SamplingParams(stop=req.stop or (), logprobs=logprobs,
                          logit_bias=_logit_bias(req.logit_bias),
                          response_format=response_format, **kw)


def remaining(fe: Frontend, prompt: list[int]) -> int:
    # At least 1 so a too-long prompt is refused as the prompt, not as max_tokens.
    return max(1, fe.model.max_model_len - len(prompt))


def given_prompts(prompt: Any) -> list[Any]:
    """The prompts of a completions request: a text, token ids, or a list of either (the batch
    form)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt_batch.check_count(len(prompt))
        return list(prompt)
    return [prompt]


def completion_prompts(fe: Frontend, prompt: Any) -> list[list[int]]:
    return [fe.encode(p) if isinstance(p, str) else list(p) for p in given_prompts(prompt)]


def echo_text(fe: Frontend, given: Any, prompt: list[int]) -> str:
    """A prompt as the client sent it: its text, or the decode of its token ids."""
    if isinstance(given, str):
        return given
    refuse(fe.tokenizer is None, "echo", "this model has no tokenizer to write the prompt")
    return fe.tokenizer.decode(prompt)


def prompt_chars(prompt: Any) -> int:
    """Characters of a completion prompt's text (0 for token ids)."""
    if isinstance(prompt, list):
        return sum(len(p) for p in prompt if isinstance(p, str))
    return len(prompt) if isinstance(prompt, str) else 0


MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id",
                          "reasoning_content", "refusal"})
_CALL_KEYS = frozenset({"id", "type", "function"})


def messages_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of the messages' text content, and checks each message's shape: an object
    whose role is a string and whose content is a string, a list of parts, or absent; no key
    this server would ignore."""
    total = 0
    for i, m in enumerate(messages):
        refuse(not isinstance(m, dict), "messages", f"[{i}] must be an object")
        chat_request.only_keys(m, MESSAGE_KEYS, f"messages[{i}]")
        refuse(not isinstance(m.get("role"), str), "messages", f"[{i}].role must be a string")
        for j, call in enumerate(m.get("tool_calls") or ()):
            if isinstance(call, dict):
                chat_request.only_keys(call, _CALL_KEYS, f"messages[{i}].tool_calls[{j}]")
                if isinstance(call.get("function"), dict):
                    chat_request.only_keys(call["function"], {"name", "arguments"},
                                           f"messages[{i}].tool_calls[{j}].function")
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for j, p in enumerate(content):
                if isinstance(p, dict):
                    chat_request.only_keys(p, {"type", "text"}, f"messages[{i}].content[{j}]")
            total += sum(len(p["text"]) for p in content
                         if isinstance(p, dict) and isinstance(p.get("text"), str))
        else:
            refuse(content is not None, "messages",
                   f"[{i}].content must be a string or a list of parts")
    return total


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Content given as a list of parts becomes one string (text parts only)."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            texts = [p.get("text") for p in content if isinstance(p, dict)]
            refuse(any(not (isinstance(p, dict) and p.get("type") == "text"
                             and isinstance(p.get("text"), str)) for p in content),
                    "messages", f"[{i}].content: only text parts are supported")
            m = {**m, "content": "\n".join(texts)}
        out.append(m)
    return out


def chat_prompt(fe: Frontend, messages: list[dict[str, Any]], tools: list[dict] | None,
                kwargs: Any, add_generation_prompt: bool = True) -> tuple[list[int], str | None]:
    """The prompt of a conversation, and the tool-call syntax to read the answer in when the
    tools had to be shown in plain text (the template would drop them; else None)."""
    msgs = chat_request.template_messages(chat_messages(messages))
    family = None
    if tools and not chat_request.template_shows_tools(fe.tokenizer):
        msgs = chat_request.with_default_tools(msgs, tools)
        tools, family = None, chat_request.DEFAULT_TOOLS_FAMILY
    ids = fe.tokenizer.apply_chat_template(msgs, add_generation_prompt, tools=tools,
                                           **chat_request.template_kwargs(kwargs))
    return ids, family


@dataclass(frozen=True)
class ChatPlan:
    prompt: list[int]
    params: SamplingParams
    output: ChatOutputSpec


def chat_plan(fe: Frontend, body: ChatCompletionRequest, names: dict[str, str]) -> ChatPlan:
    """The prompt, params and output reading of a chat request. `names` (updated in place, so
    an error raised here reads right too) maps engine field names to this request's."""
    refuse(body.chat_template is not None, "chat_template",
           "is not accepted; the checkpoint's own chat template is used")
    refuse(body.functions, "functions", "is not supported; use tools")
    refuse(body.top_logprobs is not None and not body.logprobs, "top_logprobs",
           "needs logprobs=true")
    tools = chat_request.parse_tools(body.tools)
    mode, name = chat_request.tool_choice_mode(body.tool_choice, tools)
    fmt = request_format(body)
    grammar = chat_request.tool_grammar(tools, mode, name, body.parallel_tool_calls)
    if grammar is not None:
        refuse(fmt is not None, "response_format", f"cannot be combined with tool_choice {mode}")
        fmt, names["response_format"] = grammar, "tools"
    prompt, family = chat_prompt(fe, body.messages, body.tools if tools else None,
                                 body.chat_template_kwargs)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    if max_tokens is None:
        max_tokens = remaining(fe, prompt)
    output = chat_request.output_spec(fe.tokenizer, fe.model.architecture, prompt, mode, name,
                                      tools, family)
    if fmt is not None and output.in_reasoning:  # the template opened the reasoning section
        fmt = dataclasses.replace(fmt, after=THINK_END)
    params = sampling_params(body, max_tokens,
                             (body.top_logprobs or 0) if body.logprobs else None, fmt)
    return ChatPlan(prompt, params, output)
