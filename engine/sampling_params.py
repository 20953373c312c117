"""Per-request sampling parameters, validated at construction so a bad field is named before any
KV block is allocated."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.errors import InvalidArgument

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for one bias: [-100, 100]
RESPONSE_FORMATS = ("json_object", "json_schema")
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
_UINT32_FIELDS = ("n", "max_tokens", "top_k", "min_tokens", "logprobs")


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
        if v is None and name in ("logprobs", "seed"):
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidArgument(name, f"must be an integer, got {type(v).__name__}")
        if name != "seed" and not -MAX_UINT32 <= v <= MAX_UINT32:
            raise InvalidArgument(name, f"must be at most {MAX_UINT32}, got {v}")
    if isinstance(p.priority, bool) or not isinstance(p.priority, int) or \
            not -MAX_PRIORITY <= p.priority <= MAX_PRIORITY:
        raise InvalidArgument("priority", f"must be an integer in [-{MAX_PRIORITY}, "
                              f"{MAX_PRIORITY}], got {p.priority!r}")
    for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
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
    """Structured output: the sample must be JSON (`json_object`) or JSON valid against a schema
    (`json_schema`, the schema as JSON text). The grammar is compiled once per distinct schema
    text and enforced by masking the logits (engine/grammar.py)."""

    type: str
    schema: str | None = None

    def __post_init__(self) -> None:
        if self.type not in RESPONSE_FORMATS:
            raise InvalidArgument("response_format", f"type must be one of "
                                  f"{', '.join(RESPONSE_FORMATS)}, got {self.type!r}")
        if (self.type == "json_schema") != (self.schema is not None):
            raise InvalidArgument("response_format", "a schema goes with type json_schema, "
                                  "and only with it")
        if self.schema is not None:
            if len(self.schema) > MAX_SCHEMA_CHARS:
                raise InvalidArgument("response_format", f"the schema is {len(self.schema)} "
                                      f"characters long; at most {MAX_SCHEMA_CHARS} are served")
            try:
                parsed = json.loads(self.schema)
            except (TypeError, ValueError) as e:
                raise InvalidArgument("response_format", f"the schema is not JSON: {e}") from None
            if not isinstance(parsed, dict | bool):
                raise InvalidArgument("response_format", "the schema must be a JSON object")


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token; 0: only the sampled one
    skip_special_tokens: bool = True
    min_tokens: int = 0  # EOS and stop_token_ids are held back until this many outputs
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    response_format: ResponseFormat | None = None
    # Router side only: keep the stop string that ended the sample in its text.
    include_stop_str_in_output: bool = False
    # Prefix-cache namespace: cached blocks are shared only between equal salts ("" is one).
    cache_salt: str = ""
    # Admission order under load: lower first (vLLM's convention), then the scheduler's policy.
    priority: int = 0

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
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidArgument("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
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

    def check_ids(self, field: str, ids: Sequence[int]) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(field, f"token id {bad} is outside [0, {self.vocab_size})")
