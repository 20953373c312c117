"""Per-request sampling parameters, validated at construction so a bad field is named before any
KV block is allocated."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from tandem.errors import InvalidArgument

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for one bias: [-100, 100]
# The kinds of structured output, as a request names them (the members of the proto's oneof
# response_format and the Python client's fields): kind -> the type of its value there (dict:
# JSON text on the wire, which the client also takes as an object).
FORMAT_KINDS: dict[str, type] = {"json_object": bool, "json_schema": dict, "regex": str,
                                 "choice": list, "grammar": str, "structural_tag": dict}
MAX_CHOICES = 1024
RESPONSE_FORMATS = tuple(FORMAT_KINDS)
# Beside the kind, on the wire and in the client: where the grammar starts (ResponseFormat.after).
FORMAT_AFTER = "grammar_after"
MAX_AFTER_CHARS = 64
# A schema's text at most: compiling is one thread for every request, so one caller's giant
# schema must not hold up everyone else's grammars.
MAX_SCHEMA_CHARS = 64 * 1024
# The wire carries counts and token ids as uint32: anything larger is refused here, naming the
# field, rather than failing later in a proto conversion.
MAX_UINT32 = 2**32 - 1
MAX_CACHE_SALT_CHARS = 256
MAX_PRIORITY = 2**31 - 1  # an int32 on the wire
# Lists a caller sizes: each entry costs work on every generated token.
MAX_STOP_ENTRIES = 256  # stop strings, and stop token ids
MAX_STOP_CHARS = 4096  # one stop string
MAX_LOGIT_BIAS_ENTRIES = 1024
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")
_UINT32_FIELDS = ("n", "max_tokens", "top_k", "min_tokens", "logprobs", "prompt_logprobs")


def _check_types(p: SamplingParams) -> None:
    """Strict types and ranges before any other check: a bool is not a number, a NaN or an
    infinity is not a value, and nothing exceeds what the wire carries."""
    for name in _FLOAT_FIELDS:
        v = getattr(p, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InvalidArgument(name, f"must be a number, got {type(v).__name__}")
        if not math.isfinite(v):
            raise InvalidArgument(name, f"must be a finite number, got {v}")
    for name in (*_UINT32_FIELDS, "seed"):
        v = getattr(p, name)
        if v is None and name in ("logprobs", "prompt_logprobs", "seed"):
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidArgument(name, f"must be an integer, got {type(v).__name__}")
        if name != "seed" and not -MAX_UINT32 <= v <= MAX_UINT32:
            raise InvalidArgument(name, f"must be at most {MAX_UINT32}, got {v}")
    if isinstance(p.priority, bool) or not isinstance(p.priority, int) or \
            not -MAX_PRIORITY <= p.priority <= MAX_PRIORITY:
        raise InvalidArgument("priority", f"must be an integer in [-{MAX_PRIORITY}, "
                              f"{MAX_PRIORITY}], got {p.priority!r}")
    for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                 "speculative"):
        if not isinstance(getattr(p, name), bool):
            raise InvalidArgument(name, f"must be true or false, got "
                                  f"{type(getattr(p, name)).__name__}")
    for t in p.stop_token_ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_UINT32:
            raise InvalidArgument("stop_token_ids", f"token ids must be in [0, {MAX_UINT32}], "
                                  f"got {t!r}")
    if not isinstance(p.cache_salt, str) or len(p.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidArgument("cache_salt", f"must be a string of at most "
                              f"{MAX_CACHE_SALT_CHARS} characters")
    if any(not isinstance(s, str) for s in p.stop):
        raise InvalidArgument("stop", "stop strings must be strings")
    for name in ("stop", "stop_token_ids"):
        if len(getattr(p, name)) > MAX_STOP_ENTRIES:
            raise InvalidArgument(name, f"at most {MAX_STOP_ENTRIES} entries, got "
                                  f"{len(getattr(p, name))}")
    if any(len(s) > MAX_STOP_CHARS for s in p.stop):
        raise InvalidArgument("stop", f"a stop string has at most {MAX_STOP_CHARS} characters")
    if len(p.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidArgument("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got "
                              f"{len(p.logit_bias)}")


@dataclass(frozen=True)
class ResponseFormat:
    """Structured output, enforced by a grammar that masks the logits (engine/grammar.py),
    compiled once per distinct format. `type` and its `schema` (the kind's text):

        json_object     None: any JSON object
        json_schema     JSON valid against this JSON Schema (JSON text)
        regex           text matching this regular expression
        choice          exactly one of these strings (a JSON array of strings)
        grammar         text of this EBNF grammar (xgrammar's dialect, GBNF-like: root ::= ...)
        structural_tag  xgrammar's structural tag (JSON text: {"type": "structural_tag",
                        "format": {...}}): free text with tagged parts in their own grammars

    `after`: the grammar applies once the output contains this text, which may come only once
    (the end of a reasoning section a chat template opened: "</think>"); before it the text is
    free, but the sample cannot end. Empty: from the first token."""

    type: str
    schema: str | None = None
    after: str = ""

    def __post_init__(self) -> None:
        if self.type not in RESPONSE_FORMATS:
            raise InvalidArgument("response_format", f"type must be one of "
                                  f"{', '.join(RESPONSE_FORMATS)}, got {self.type!r}")
        if (self.type == "json_object") != (self.schema is None):
            raise InvalidArgument("response_format", f"{self.type} takes "
                                  f"{'no' if self.type == 'json_object' else 'a'} "
                                  "specification")
        if not isinstance(self.after, str) or len(self.after) > MAX_AFTER_CHARS:
            raise InvalidArgument(FORMAT_AFTER, f"must be a string of at most "
                                  f"{MAX_AFTER_CHARS} characters")
        if self.schema is not None:
            self._check_spec(self.schema)

    def _check_spec(self, spec: str) -> None:
        what = "schema" if self.type == "json_schema" else self.type
        if not isinstance(spec, str) or not spec:
            raise InvalidArgument("response_format", f"the {what} must be non-empty text")
        if len(spec) > MAX_SCHEMA_CHARS:
            raise InvalidArgument("response_format", f"the {what} is {len(spec)} characters "
                                  f"long; at most {MAX_SCHEMA_CHARS} are served")
        if FORMAT_KINDS[self.type] not in (dict, list):
            return
        try:
            parsed = json.loads(spec)
        except (TypeError, ValueError) as e:
            raise InvalidArgument("response_format", f"the {what} is not JSON: {e}") from None
        if self.type == "json_schema" and not isinstance(parsed, dict | bool):
            raise InvalidArgument("response_format", "the schema must be a JSON object")
        if self.type == "structural_tag" and not isinstance(parsed, dict):
            raise InvalidArgument("response_format", "the structural tag must be a JSON object")
        if self.type == "choice" and (
                not isinstance(parsed, list) or not 1 <= len(parsed) <= MAX_CHOICES
                or not all(isinstance(c, str) and c for c in parsed)):
            raise InvalidArgument("response_format", f"choice must be 1 to {MAX_CHOICES} "
                                  "non-empty strings")


# How a parameter reaches each surface. The engine's SamplingParams below is the one
# declaration of the request parameters: the wire conversion (runtime/convert.py), the Python
# client's dataclass (generated, tandem/client/params.py), the OpenAI fields
# (router_svc/openai_requests.py), the gRPC error paths (`params.<name>`), the flags of
# `tandem generate` and every default are derived from it; tests/unit/test_params_seam.py holds
# the proto (whose field numbers a person chooses) equal to it.
SAME = "same"  # an OpenAI request field of the same name, type and meaning (derived)
MAPPED = "mapped"  # OpenAI spells it its own way: openai_requests.py maps it by hand


@dataclass(frozen=True)
class Param:
    """What a SamplingParams field says of itself beyond its type and default."""

    doc: str  # one line: the CLI's help, the client's and the docs' description
    example: Any  # a valid value other than the default (the seam's tests send it everywhere)
    openai: str = SAME  # SAME or MAPPED
    cli: bool = False  # a `tandem generate` flag, --name-with-dashes


def param(default: Any, doc: str, example: Any, *, openai: str = SAME,
          cli: bool = False) -> Any:
    return field(default=default, metadata={"param": Param(doc, example, openai, cli)})


@dataclass(frozen=True)
class SamplingParams:
    n: int = param(1, "samples per prompt", 2, cli=True)
    max_tokens: int = param(16, "tokens to generate per sample", 5, openai=MAPPED, cli=True)
    temperature: float = param(1.0, "0 = greedy", 0.5, cli=True)
    top_p: float = param(1.0, "nucleus sampling: the smallest set of tokens with this much "
                         "probability, in (0, 1]", 0.9, cli=True)
    top_k: int = param(0, "the k likeliest tokens only (0: off)", 40, openai=MAPPED, cli=True)
    min_p: float = param(0.0, "tokens at least this fraction of the likeliest one's "
                         "probability (0: off)", 0.05, cli=True)
    repetition_penalty: float = param(1.0, "logits of tokens already in prompt or output "
                                      "shrunk by this factor (1: off)", 1.2, cli=True)
    presence_penalty: float = param(0.0, "subtracted from the logit of every token already "
                                    "generated, in [-2, 2]", 0.5, cli=True)
    frequency_penalty: float = param(0.0, "subtracted once per occurrence in the output, in "
                                     "[-2, 2]", 0.5, cli=True)
    seed: int | None = param(None, "seed of the sample's randomness (reproducible across "
                             "workers)", 7, cli=True)
    stop: tuple[str, ...] = param((), "stop strings, cut from the text", ("\n\n",),
                                  openai=MAPPED, cli=True)
    stop_token_ids: tuple[int, ...] = param((), "token ids that end a sample", (3,), cli=True)
    ignore_eos: bool = param(False, "go on past the end-of-sequence token", True, cli=True)
    logprobs: int | None = param(None, "top-N log-probabilities per generated token (0: the "
                                 "sampled token's only)", 2, openai=MAPPED, cli=True)
    skip_special_tokens: bool = param(True, "leave special tokens out of the text", False)
    min_tokens: int = param(0, "end-of-sequence and stop_token_ids held back until this many "
                            "tokens", 1, cli=True)
    logit_bias: tuple[tuple[int, float], ...] = param(
        (), "token id -> added to its logit, in [-100, 100]", ((5, 1.5),), openai=MAPPED)
    response_format: ResponseFormat | None = param(  # noqa: RUF009 - a frozen example
        None, "structured output, enforced by a grammar",
        ResponseFormat("json_object", None, "</think>"), openai=MAPPED)
    # Router side only: the detokenizer there applies stop strings.
    include_stop_str_in_output: bool = param(False, "keep the stop string that ended a sample "
                                             "in its text", True)
    # Cached blocks are shared only between equal salts ("" is one; API keys add their own).
    cache_salt: str = param("", "prefix-cache namespace: requests share cached prompt blocks "
                            "only with requests of the same salt", "tenant-a")
    # Then the scheduler's policy (engine/wait_queue.py).
    priority: int = param(0, "admission order under load: lower first (vLLM's convention)", -1,
                          cli=True)
    prompt_logprobs: int | None = param(None, "top-N log-probabilities at each prompt token "
                                        "after the first (0: the prompt token's only)", 1)
    # False: this sample decodes one token per step even where the worker speculates.
    speculative: bool = param(True, "let the worker speculate on this sample (the output is the "
                              "same either way; speculation only changes the speed)", False)

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and stored as tuples (hashable, immutable).
        object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str)
                                               else self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_types(self)
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        if self.n < 1:
            raise InvalidArgument("n", f"must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise InvalidArgument("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise InvalidArgument("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgument("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgument("top_k", f"must be >= 0 (0 disables), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise InvalidArgument("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise InvalidArgument("repetition_penalty",
                                  f"must be > 0, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise InvalidArgument("presence_penalty",
                                  f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise InvalidArgument("frequency_penalty",
                                  f"must be in [-2, 2], got {self.frequency_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_LOGPROBS:
                raise InvalidArgument(name, f"must be in [0, {MAX_LOGPROBS}], got {v}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidArgument("seed", f"must be in [0, 2**63), got {self.seed}")
        if any(not s for s in self.stop):
            raise InvalidArgument("stop", "stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidArgument("stop_token_ids", "token ids must be >= 0")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidArgument("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], "
                                  f"got {self.min_tokens}")
        for tok, b in self.logit_bias:
            if not 0 <= tok <= MAX_UINT32:
                raise InvalidArgument("logit_bias", f"token id {tok} is outside [0, {MAX_UINT32}]")
            if not math.isfinite(b):
                raise InvalidArgument("logit_bias", f"bias of token {tok} must be finite")
            if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                raise InvalidArgument("logit_bias", f"bias {b} of token {tok} is outside "
                                      f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if self.response_format is not None and self.ignore_eos:
            raise InvalidArgument("ignore_eos", "cannot be combined with response_format: the "
                                  "grammar ends the output")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def request_params() -> tuple[Any, ...]:
    """The dataclass fields of SamplingParams that a request sets (those declared with
    `param`), in declaration order; the others are the engine's own."""
    return tuple(f for f in fields(SamplingParams) if "param" in f.metadata)


def param_spec(f: Any) -> Param:
    return f.metadata["param"]


@dataclass(frozen=True)
class Logprob:
    """Log-probability of one token under the model's raw distribution (before temperature,
    penalties and truncation), as OpenAI reports it."""

    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprobs:
    sampled: Logprob
    top: tuple[Logprob, ...] = field(default=())


@dataclass(frozen=True)
class RequestLimits:
    """What a request's ids and lengths must respect. `check` is the one place a request is
    checked against the model: the router before routing it, the engine before a block is
    allocated, a decode worker before its engine core sees it."""

    vocab_size: int  # token ids are in [0, vocab_size)
    max_model_len: int  # tokens in all, prompt included
    max_n: int  # samples per request

    def check(self, prompt: Sequence[int], params: SamplingParams,
              ids_field: str = "prompt") -> None:
        """Raises InvalidArgument naming the first bad field (`ids_field`: what the caller calls
        the prompt's token ids)."""
        if not prompt:
            raise InvalidArgument("prompt", "must not be empty")
        self.check_length(len(prompt))  # before any work proportional to the prompt
        self.check_max_tokens(len(prompt), params.max_tokens)
        self.check_ids(ids_field, prompt)
        if params.n > self.max_n:
            raise InvalidArgument("n", f"must be <= {self.max_n}, got {params.n}")
        self.check_ids("logit_bias", [t for t, _ in params.logit_bias])

    def check_length(self, num_tokens: int) -> None:
        if num_tokens >= self.max_model_len:
            raise InvalidArgument(
                "prompt", f"{num_tokens} tokens; this model serves at most "
                f"{self.max_model_len} tokens in all, prompt included, so at most "
                f"{self.max_model_len - 1}")

    def check_max_tokens(self, prompt_tokens: int, max_tokens: int) -> None:
        """The outputs asked for must fit beside the prompt: never silently fewer (as vLLM)."""
        room = self.max_model_len - prompt_tokens
        if max_tokens > room:
            raise InvalidArgument(
                "max_tokens", f"{max_tokens} tokens asked for, but this model serves at most "
                f"{self.max_model_len} tokens in all and the prompt has {prompt_tokens}, so at "
                f"most {room}")

    def check_ids(self, field: str, ids: Sequence[int]) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(field, f"token id {bad} is outside [0, {self.vocab_size})")
