"""Structured outputs: grammars compiled by xgrammar, one matcher per sample.

    ResponseFormat ──compile once per distinct schema text (LRU)──▶ CompiledGrammar
    each sample: GrammarState(matcher) ── fill its row of the step's token bitmask (CPU)
                                       ── the sampler masks the logits on the device
                                       ── accept the sampled token (the engine, per sample)

The matcher lives with its Sequence. It advances with each token the sequence appends, so a
preempted sequence (recomputed, same tokens) keeps it, a fork copies it, and a decode worker
rebuilds it from the first tokens the prefill worker sampled under the same grammar (the
schema travels in the request's SamplingParams). EOS is allowed only once the grammar is
complete: the tokenizer info names the engine's EOS ids as the grammar's stop tokens.

The engine core has no tokenizer of its own: the first request with a grammar loads the
checkpoint's tokenizer to build xgrammar's TokenizerInfo, sized to the tokenizer's vocabulary
(and the engine's EOS ids, which end a grammar). The model's logits may be wider (an embedding padded past the tokenizer): those ids are never
allowed, masked on the device beside the grammar's mask (`apply_bitmask`), not handed to
xgrammar, which would treat each as a special token and pay for all of them in every fill (an
8B Llama config with SmolLM2's 49k tokenizer: 14x the host work a step).

Compiling takes from milliseconds to seconds (a large vocabulary, a big schema): it runs on a
thread of its own (`submit`), and the engine holds the request back until its grammar is ready,
so the step loop never waits for it.

xgrammar is imported on first use (it is slow to import).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.engine.sampling_params import ResponseFormat
from tandem.engine.tokenizer import Tokenizer, has_tokenizer
from tandem.errors import InvalidArgument

# torch is imported where masks are filled and applied (in an engine, which has it loaded): the
# router imports this module for check_schema alone and starts without torch.
if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

XGRAMMAR = "xgrammar>=0.2.8,<0.3"  # a dependency (pyproject.toml); missing only where removed
CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first


def xgrammar() -> Any:
    """The xgrammar module, or InvalidArgument naming the extra that installs it."""
    try:
        import xgrammar as xgr  # noqa: PLC0415 - optional, and slow to import
    except ImportError:
        raise InvalidArgument(
            "response_format", "structured outputs need the xgrammar package, which is not "
            f"installed here: pip install '{XGRAMMAR}'") from None
    return xgr


def check_schema(fmt: ResponseFormat) -> None:
    """Refuse a response format xgrammar cannot turn into a grammar, or any when xgrammar is
    missing (no tokenizer needed: the router calls this to answer 400 before any worker sees
    the request)."""
    _check_format(fmt.type, fmt.schema, fmt.after)


@functools.lru_cache(maxsize=CACHE_SIZE)
def _check_format(kind: str, schema: str | None, after: str) -> None:
    xgrammar()  # ImportError first, naming the extra
    try:
        format_grammar(ResponseFormat(kind, schema, after))
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError with its reason
        raise InvalidArgument("response_format", f"the {_what(kind)} cannot be used: "
                              f"{_reason(e)}") from None


# JSON Schema keywords the grammar enforces exactly (every output it allows validates), checked
# against sampled outputs by tests/unit/test_grammar.py; annotations change nothing. A strict
# schema with any other keyword is refused naming it: xgrammar ignores uniqueItems, if/then,
# dependentRequired and more, writes not, allOf and contains approximately, lets a maxLength
# beside a pattern or format go, and its formats admit invalid values (a 31st of November, an
# IPv4 address with leading zeros).
ENFORCED_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "enum", "const", "anyOf", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf", "minLength", "maxLength", "pattern", "$ref", "$defs",
    "definitions"})
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id",
                         "$comment", "deprecated", "readOnly", "writeOnly"})
_SCHEMA_MAPS = ("properties", "$defs", "definitions")  # name -> subschema
_SCHEMA_LISTS = ("anyOf", "prefixItems")


def unenforced_keyword(schema: Any, path: str = "") -> str | None:
    """The path of the first keyword in `schema` that the grammar would not enforce exactly
    (e.g. "properties.tags.uniqueItems"), or None."""
    if not isinstance(schema, dict):
        return None
    for key, value in schema.items():
        where = f"{path}.{key}" if path else key
        if key in ANNOTATIONS:
            continue
        if key not in ENFORCED_KEYWORDS:
            return where
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            found = next((w for name, sub in value.items()
                          if (w := unenforced_keyword(sub, f"{where}.{name}"))), None)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            found = next((w for i, sub in enumerate(value)
                          if (w := unenforced_keyword(sub, f"{where}[{i}]"))), None)
        elif key in ("items", "additionalProperties"):
            found = unenforced_keyword(value, where)
        else:
            found = None
        if found:
            return found
    if "pattern" in schema:  # xgrammar lets a length beside a pattern go
        length = next((k for k in ("minLength", "maxLength") if k in schema), None)
        if length is not None:
            return f"{path}.{length}" if path else length
    return None


def check_strict(schema_text: str, field: str = "response_format") -> None:
    """Refuse a strict schema whose every keyword the grammar cannot enforce, naming the
    first such keyword: never an output that a strict schema's validator would refuse."""
    where = unenforced_keyword(json.loads(schema_text))
    if where is not None:
        keyword = where.rsplit(".", 1)[-1]
        raise InvalidArgument(field, f"the strict schema's keyword {keyword!r} (at {where}) is "
                              "not enforced by the grammar; remove it, or set strict to false "
                              "to have the rest enforced")


class GrammarState:
    """One sample's position in its grammar.

    A token sampled under this grammar's own mask is taken with `defer`: the matcher advances
    over it at the start of the next fill, which runs on the host while the device computes the
    next step's logits, instead of between two steps while the device waits. Such a token is
    allowed by construction; if the matcher still refuses it, the state is `broken` and its
    next mask allows only the end of sequence. A token from elsewhere (a prefill worker's first
    token, a moved request's outputs) is checked at once with `accept`."""

    __slots__ = ("broken", "matcher", "pending", "vocab_size")

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # the grammar's token ids: [0, vocab_size)
        self.pending: int | None = None
        self.broken = False

    def flush(self) -> None:
        if self.pending is not None:
            token, self.pending = self.pending, None
            if not self.matcher.accept_token(token):
                log.error("a token sampled under its grammar's mask (%d) broke the grammar; "
                          "ending the sample", token)
                self.broken = True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of a CPU int32 bitmask (as wide as
        the grammar's vocabulary or wider: ids past it are not allowed)."""
        fill_bitmask([self], bitmask, [row], [])

    def accept(self, token_id: int) -> bool:
        """Advance by one token now; False if the grammar does not allow it."""
        self.flush()
        return self.matcher.accept_token(token_id)

    def defer(self, token_id: int) -> None:
        """Advance by a token sampled under this grammar's mask, at the next fill."""
        self.flush()
        self.pending = token_id

    def fork(self) -> GrammarState:
        self.flush()
        child = GrammarState(self.matcher.fork(), self.vocab_size)
        child.broken = self.broken
        return child

    @property
    def terminated(self) -> bool:
        self.flush()
        return self.matcher.is_terminated()


class GrammarCompiler:
    """Compiles response formats against one model's tokenizer, once per distinct schema."""

    def __init__(self, model_dir: Path | None, vocab_size: int, eos_token_ids: list[int],
                 cache_size: int = CACHE_SIZE) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size  # the model's logits, >= the tokenizer's vocabulary
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_size = cache_size
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, str | None, str], Any] = OrderedDict()
        self._pending: dict[tuple[str, str | None, str], Future] = {}
        self._lock = threading.Lock()  # the cache and the pending compiles
        self._executor: ThreadPoolExecutor | None = None
        self.num_compiled = 0

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            xgr = xgrammar()
            hf = self._hf_tokenizer()
            # The tokenizer's ids and the engine's EOS ids (see the module docstring): ids
            # past them are masked on the device.
            vocab = min(self.vocab_size,
                        max([*hf.get_vocab().values(), *self.eos_token_ids]) + 1)
            info = xgr.TokenizerInfo.from_huggingface(
                hf, vocab_size=vocab, stop_token_ids=self.eos_token_ids)
            # Our own LRU keeps what is compiled; xgrammar's cache would keep a second copy.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def _hf_tokenizer(self) -> Any:
        d = self.model_dir
        if not has_tokenizer(d):
            raise InvalidArgument("response_format", "this model has no tokenizer, which "
                                  "structured outputs need")
        return Tokenizer(d).hf

    def submit(self, fmt: ResponseFormat) -> Future:
        """The compiled grammar of `fmt`, now if cached, else from the compile thread (one
        compile per schema however many requests wait for it). Its exception is an
        InvalidArgument if the schema cannot be compiled."""
        key = (fmt.type, fmt.schema, fmt.after)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                done: Future = Future()
                done.set_result(compiled)
                return done
            fut = self._pending.get(key)
            if fut is None:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar")
                fut = self._pending[key] = self._executor.submit(self._compile, key, fmt)
            return fut

    def compile(self, fmt: ResponseFormat) -> Any:
        """The compiled grammar of `fmt`, waiting for it; InvalidArgument if it cannot be."""
        return self.submit(fmt).result()

    def _compile(self, key: tuple[str, str | None, str], fmt: ResponseFormat) -> Any:
        try:
            compiled = self._get_compiler().compile_grammar(format_grammar(fmt))
        except Exception as e:  # xgrammar raises RuntimeError with its reason
            with self._lock:
                self._pending.pop(key, None)
            if isinstance(e, InvalidArgument):
                raise
            raise InvalidArgument("response_format", f"the {_what(fmt.type)} cannot be "
                                  f"compiled: {_reason(e)}") from None
        with self._lock:  # cached before it stops pending: no second compile in between
            self._pending.pop(key, None)
            self.num_compiled += 1
            self._cache[key] = compiled
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def state(self, fmt: ResponseFormat) -> GrammarState:
        """A fresh matcher at the start of `fmt`'s grammar."""
        return self.state_of(self.compile(fmt))

    @staticmethod
    def state_of(compiled: Any) -> GrammarState:
        return GrammarState(xgrammar().GrammarMatcher(compiled), compiled.tokenizer_info.vocab_size)


# JSON strings as xgrammar 0.2.8 writes them let through what a strict parser refuses: every
# string rule admits UTF-8-encoded surrogates (U+D800-U+DFFF, invalid UTF-8: they decode to
# U+FFFD, so a "maxLength" string grows), and a length-bounded string ("maxLength") admits raw
# control characters (JSON allows them only escaped). Both are closed in the grammar's text.
_CONTROL = r"\0-\x1f"
_LOOSE_CHARS = r'[^\"\\\r\n]'
_STRICT_CHARS = r"\0-\x1f\ud800-\udfff"


def _strict_strings(ebnf: str) -> str:
    ebnf = ebnf.replace(_CONTROL, _STRICT_CHARS)
    return ebnf.replace(_LOOSE_CHARS, r'[^\"\\' + _STRICT_CHARS + "]")


def format_grammar(fmt: ResponseFormat) -> Any:
    """The grammar of `fmt`: its kind's, from the start, or once the output holds `fmt.after`
    (free text up to that text's first occurrence, which must come: xgrammar's structural tag,
    matched on the text, however the model's tokens split it)."""
    grammar = _kind_grammar(fmt)
    if not fmt.after:
        return grammar
    return xgrammar().Grammar.from_structural_tag(json.dumps({
        "type": "structural_tag", "format": {"type": "sequence", "elements": [
            {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": fmt.after},
            {"type": "grammar", "grammar": str(grammar)}]}}))


def _kind_grammar(fmt: ResponseFormat) -> Any:
    xgr = xgrammar()
    spec = fmt.schema
    if fmt.type in ("json_object", "json_schema"):
        return schema_grammar(spec)
    if fmt.type == "regex":
        return xgr.Grammar.from_regex(spec)
    if fmt.type == "choice":  # one alternative per string, each a literal
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec))
        return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
    if fmt.type == "grammar":
        return xgr.Grammar.from_ebnf(spec)
    return xgr.Grammar.from_structural_tag(spec)  # structural_tag


def schema_grammar(schema: str | None) -> Any:
    """The grammar of JSON valid against `schema` (None: any JSON object): compact (with any
    whitespace allowed, a weak model can pad forever), strings strictly valid."""
    xgr = xgrammar()
    ebnf = str(xgr.Grammar.from_json_schema(schema or '{"type": "object"}',
                                            any_whitespace=False))
    return xgr.Grammar.from_ebnf(_strict_strings(ebnf))


def fill_bitmask(states: list[GrammarState], bitmask: torch.Tensor, rows: list[int],
                 eos_token_ids: list[int]) -> None:
    """Each state's allowed tokens into its row of `bitmask` (the deferred tokens taken first),
    the rows in parallel on xgrammar's threads (half the cores): at 256 rows one at a time this
    is most of a decode step. A broken state's row allows only `eos_token_ids`."""
    import torch  # noqa: PLC0415 - see the imports

    # One accept_token call a row. xgrammar's batch_accept_token is no faster: it runs the same
    # matcher code one row after another on this thread, and its wrapper's per-row conversions
    # cost more than the calls it saves (benchmarks/engine/grammar_step.py, 2-core VM, 256 rows:
    # 0.74 ms a step serial, 0.82 ms batched, beside a 37 ms fill).
    for s in states:
        s.flush()
    words = bitmask_width(states[0].vocab_size)  # every state of one engine: one tokenizer
    # xgrammar fills rows exactly as wide as its vocabulary; a wider bitmask (the sampler's is
    # not) gets them copied in, with the padding ids' words zeroed.
    target = bitmask if bitmask.shape[1] == words else torch.empty(
        (bitmask.shape[0], words), dtype=torch.int32)
    if len(states) == 1:
        states[0].matcher.fill_next_token_bitmask(target, rows[0])
    else:
        _batch_matcher().batch_fill_next_token_bitmask([s.matcher for s in states], target,
                                                       rows)
    if target is not bitmask:
        bitmask[rows, :words] = target[rows]
        bitmask[rows, words:] = 0
    for s, row in zip(states, rows, strict=True):
        if s.broken:
            bitmask[row] = 0
            for t in eos_token_ids:
                if t < s.vocab_size:
                    bitmask[row, t // 32] |= 1 << (t % 32)


@functools.cache
def _batch_matcher() -> Any:
    return xgrammar().BatchGrammarMatcher("auto")


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask (one bit per token id)."""
    return (vocab_size + 31) // 32


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                  vocab_size: int) -> None:
    """Set to -inf, in place, the logits of rows `rows` whose bit is 0 in the CPU `bitmask`
    (one row per row of logits, covering the grammar's `vocab_size` ids), and every logit of
    those rows past vocab_size. xgrammar's kernel on CUDA, its C++ loop on the CPU."""
    import torch  # noqa: PLC0415 - see the imports

    xgr = xgrammar()
    mask = bitmask.to(logits.device, non_blocking=True) if logits.is_cuda else bitmask
    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab_size, indices=rows)
    if vocab_size < logits.shape[-1]:
        idx = torch.tensor(rows, dtype=torch.long)
        if logits.is_cuda:
            idx = idx.pin_memory().to(logits.device, non_blocking=True)
        logits[:, vocab_size:].index_fill_(0, idx, float("-inf"))


def _what(kind: str) -> str:
    return "schema" if kind.startswith("json") else kind.replace("_", " ")


def _reason(e: Exception) -> str:
    """xgrammar's message without its source location prefix ("[time] file.cc:123: ")."""
    text = str(e).strip()
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
    return text.splitlines()[0] if text else type(e).__name__
