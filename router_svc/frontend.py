"""What both public APIs (gRPC and OpenAI HTTP) share: validation, admission, and turning the
workers' token stream into text deltas per sample, cut at stop strings, with running usage."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from tandem.engine.config import MAX_N, ModelConfig
from tandem.engine.detokenizer import DetokenizerStep, IncrementalDetokenizer
from tandem.engine.grammar import check_schema
from tandem.engine.sampling_params import (
    RequestLimits,
    ResponseFormat,
    SamplingParams,
    TokenLogprobs,
)
from tandem.engine.tokenizer import Tokenizer
from tandem.errors import InvalidArgument, Overloaded
from tandem.router_svc.orchestrator import Orchestrator
from tandem.router_svc.request_record import refused_call, router_request
from tandem.router_svc.schema_check import SchemaChecker
from tandem.router_svc.workers import OFF_LOOP_TOKENS
from tandem.runtime.request_trace import ApiCall
from tandem.runtime.telemetry import Telemetry

MAX_REQUEST_ID_CHARS = 128


class ModelNotFound(LookupError):
    """The request names a model this router does not serve."""


@dataclass
class Delta:
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs | None]
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: str | None = None  # the stop string that ended the sample
    # params.prompt_logprobs: prompt tokens 1.., on each sample's first delta
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0


@dataclass
class ModelInfo:
    id: str
    architecture: str
    max_model_len: int
    vocab_size: int
    dtype: str
    block_size: int
    max_n: int = MAX_N
    aliases: tuple[str, ...] = ()  # other names requests may use (the --model path)


class Frontend:
    def __init__(self, tokenizer: Tokenizer | None, orchestrator: Orchestrator, model: ModelInfo,
                 max_requests: int = 1024, telemetry: Telemetry | None = None,
                 schemas: SchemaChecker | None = None) -> None:
        self.tokenizer = tokenizer
        self.orchestrator = orchestrator
        self.model = model
        self.max_requests = max_requests
        self.telemetry = telemetry or Telemetry("router")
        if self.telemetry.tracing.enabled:  # the calls to workers: CLIENT spans of this tracer
            orchestrator.tracer = self.telemetry.tracer
        self.active = 0
        self.schemas = schemas  # structured outputs' grammars, checked within a time budget
        # A text longer than this has more tokens than the model takes: it is refused before
        # the tokenizer runs (a 20 MB prompt took the tokenizer 24 s).
        self.max_prompt_chars = (model.max_model_len * tokenizer.max_token_chars()
                                 if tokenizer is not None else 0)

    @staticmethod
    def model_info(model_id: str, cfg: ModelConfig, dtype: str, block_size: int,
                   max_model_len: int | None, aliases: tuple[str, ...] = ()) -> ModelInfo:
        limit = min(max_model_len or cfg.max_model_len, cfg.max_model_len)
        return ModelInfo(model_id, cfg.architecture, limit, cfg.vocab_size, dtype, block_size,
                         aliases=aliases)

    @staticmethod
    def new_request_id() -> str:
        """Random (122 bits): a request id says nothing of other requests."""
        return f"req-{uuid.uuid4().hex}"

    @staticmethod
    def scoped_request_id(request_id: str, tenant: str) -> str:
        """The id a caller-chosen `request_id` has inside the cluster: its tenant's own, so
        another tenant sending the same id neither finds it in use (learning it is live) nor
        takes it. The caller's id, then a digest of tenant and id (64 bits: no tenant can
        aim at another's); at most 128 characters. Without API keys: the id as given."""
        if not tenant:
            return request_id
        digest = hashlib.sha256(f"{tenant}\0{request_id}".encode()).hexdigest()[:16]
        return f"{request_id[:MAX_REQUEST_ID_CHARS - 17]}.{digest}"

    def check_model(self, name: str | None) -> None:
        if name and name != self.model.id and name not in self.model.aliases:
            raise ModelNotFound(f"model {name!r} is not served here (serving {self.model.id!r})")

    @staticmethod
    def for_tenant(params: SamplingParams, tenant: str) -> SamplingParams:
        """`params` with the cache namespace of the caller's tenant (its API key) and its own
        cache_salt: prompts share cached blocks only within one namespace. Without API keys and
        salt: the one shared namespace."""
        if not tenant and not params.cache_salt:
            return params
        ns = hashlib.sha256(f"{tenant}\0{params.cache_salt}".encode()).hexdigest()[:32]
        return dataclasses.replace(params, cache_salt=ns)

    def check_chars(self, chars: int, field: str = "prompt") -> None:
        """Refuse a text that cannot fit the model, by its length alone (no tokenizer run)."""
        if self.tokenizer is not None and chars > self.max_prompt_chars:
            raise InvalidArgument(field, f"{chars} characters; this model serves at most "
                                  f"{self.model.max_model_len} tokens, which is at most "
                                  f"{self.max_prompt_chars} characters")

    def check_ids_count(self, count: int) -> None:
        """Refuse a prompt of more token ids than the model takes, by its length alone."""
        RequestLimits(self.model.vocab_size, self.model.max_model_len,
                      self.model.max_n).check_length(count)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidArgument("prompt", "this model has no tokenizer; send token ids")
        self.check_chars(len(text))
        return self.tokenizer.encode(text)

    async def run_off_loop(self, fn, *args):
        """fn(*args) in a worker thread: tokenizing and chat templates never hold up the
        event loop that serves every other client."""
        return await asyncio.to_thread(fn, *args)

    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        """Everything that can be refused before a worker sees the request, but the grammar
        (check_grammar, which stream() awaits)."""
        RequestLimits(self.model.vocab_size, self.model.max_model_len,
                      self.model.max_n).check(prompt, params)
        if params.stop and self.tokenizer is None:
            raise InvalidArgument("stop", "this model has no tokenizer to match stop strings")
        if params.response_format is not None and self.tokenizer is None:
            raise InvalidArgument("response_format", "this model has no tokenizer, which "
                                  "structured outputs need")

    async def check_grammar(self, fmt: ResponseFormat | None) -> None:
        """Refuse a response format whose grammar cannot be built, or not within the checker's
        budget: in the checker's processes, never on the event loop (without a checker, as in
        tests and in-process uses: on a thread, without a budget)."""
        if fmt is None or self.tokenizer is None:
            return  # validate() refused it already
        if self.schemas is not None:
            await self.schemas.check(fmt)
        else:
            await self.run_off_loop(check_schema, fmt)

    async def check(self, prompt: list[int], params: SamplingParams) -> None:
        """validate(), in a worker thread for a long prompt: checking every token id of 100k
        tokens (about 20 ms) would hold every other request on the event loop."""
        if len(prompt) >= OFF_LOOP_TOKENS:
            await asyncio.to_thread(self.validate, prompt, params)
        else:
            self.validate(prompt, params)

    def refused(self, request_id: str, error: BaseException, api: ApiCall | None = None,
                operation: str | None = None) -> None:
        """Trace and log a request the API refused before it reached stream() (its parameters
        did not parse): one span, ended with the refusal's error.type, and one log line."""
        router_request(self.telemetry, request_id, None, None, self.model.id,
                       operation or _operation(request_id), api=api).end(1, 0, 0, error)

    def refused_call(self, name: str, error: BaseException, api: ApiCall | None = None) -> None:
        """Trace and log a call to anything but generation (listing models, tokenizing) that
        the API refused (its API key): one span named `name`, one log line."""
        refused_call(self.telemetry, name, error, api or ApiCall())

    async def stream(self, request_id: str, prompt: list[int], params: SamplingParams,
                     timeout: float | None = None, operation: str | None = None,
                     api: ApiCall | None = None) -> AsyncIterator[tuple[list[Delta], Usage]]:
        """Deltas per engine step until every sample finished. Leaving early cancels the
        request on its workers. `operation`: the GenAI operation name for its trace (default:
        chat for an OpenAI chat completion id, else text_completion); `api`: what the API
        knows for the trace (streaming or not, its address, the chat messages, the caller's
        trace context). A refused request is traced too."""
        started = time.monotonic()
        record = router_request(
            self.telemetry, request_id, prompt, params, self.model.id,
            operation or _operation(request_id),
            self.tokenizer.decode if self.tokenizer else None, api)
        try:
            await self.check(prompt, params)
            if self.active >= self.max_requests:
                raise Overloaded(f"{self.active} requests in flight (limit "
                                 f"{self.max_requests})")
            await self.check_grammar(params.response_format)
        except BaseException as e:
            record.end(0, 0, 0, e)  # refused: no sample ever started (n may be absurd)
            raise
        self.active += 1
        record.admit()
        usage = Usage(prompt_tokens=len(prompt))
        error: BaseException | None = None
        try:
            dets = [IncrementalDetokenizer(self.tokenizer, prompt, params.skip_special_tokens,
                                           params.stop) if self.tokenizer else _NoText()
                    for _ in range(params.n)]
            done: set[int] = set()
            sent = [0] * params.n  # tokens each sample's deltas carried so far
            prompt_sent = False
            # aclosing: leaving early closes the workers' legs now, not at garbage collection.
            updates = self.orchestrator.run(request_id, prompt, params, timeout, record.context)
            async with aclosing(updates):
                async for update in updates:
                    usage.cached_prompt_tokens = update.num_cached_tokens
                    # Once: a request moved to another worker may bring them again.
                    prompt_lps = None if prompt_sent else update.prompt_logprobs
                    prompt_sent = prompt_sent or prompt_lps is not None
                    deltas = []
                    new_tokens = 0
                    for s in update.samples:
                        if s.index in done:
                            continue  # past its stop string: the worker may still be generating
                        usage.completion_tokens += len(s.token_ids)
                        new_tokens += len(s.token_ids)
                        record.sample_tokens_add(s.index, len(s.token_ids))
                        det = dets[s.index]
                        step = det.push(s.token_ids)
                        d = Delta(s.index, s.token_ids, step.text_delta, s.logprobs,
                                  prompt_logprobs=prompt_lps)
                        if step.stopped:
                            d.finish_reason, d.stop_reason = "stop", step.stop_reason
                            if params.include_stop_str_in_output:
                                d.text += step.stop_reason or ""
                            _keep_tokens_of_text(d, det, sent[s.index],
                                                 params.include_stop_str_in_output)
                        elif s.finish_reason is not None:
                            d.text += det.flush()
                            d.finish_reason = s.finish_reason
                        sent[s.index] += len(d.token_ids)
                        record.text(d.index, d.text)
                        if d.finish_reason is not None:
                            done.add(s.index)
                            record.sample_finished(s.index, d.finish_reason)
                        deltas.append(d)
                    record.tokens(new_tokens)
                    if deltas:
                        yield deltas, usage
                    if len(done) == params.n:
                        return
        except BaseException as e:  # recorded (client gone, worker error), then re-raised
            error = e
            if isinstance(e, asyncio.CancelledError) and timeout is not None and \
                    time.monotonic() >= started + timeout:
                # gRPC cancels a call whose deadline passed: a deadline, not a caller leaving.
                error = TimeoutError("deadline exceeded")
            raise
        finally:
            self.active -= 1
            record.end(params.n, usage.completion_tokens, usage.cached_prompt_tokens, error)


def _keep_tokens_of_text(d: Delta, det: IncrementalDetokenizer, sent: int,
                         with_stop_str: bool) -> None:
    """A sample cut by a stop string: its delta's tokens (and their logprobs) end with the last
    one whose text is still in the answer; those the stop string removed go too."""
    if det.stop_at is None:
        return
    end = det.stop_at + (len(det.stop_reason or "") if with_stop_str else 0)
    keep = max(0, det.tokens_before(end) - sent)
    d.token_ids, d.logprobs = d.token_ids[:keep], d.logprobs[:keep]


def _operation(request_id: str) -> str:
    """The GenAI operation name: the OpenAI API names chat completions chatcmpl-*."""
    return "chat" if request_id.startswith("chatcmpl-") else "text_completion"


class _NoText:
    """Stands in for the detokenizer when the model has no tokenizer (token ids only)."""

    def push(self, token_ids: list[int]) -> DetokenizerStep:
        return DetokenizerStep("")

    def flush(self) -> str:
        return ""
