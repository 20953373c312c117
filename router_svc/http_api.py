"""The OpenAI-compatible HTTP API: a thin FastAPI layer over the Frontend, served by uvicorn in
the router's own event loop.

    request body (pydantic) ─▶ prompt ids + SamplingParams ─▶ Frontend.stream ─▶ OpenAI objects
                                                                                 (JSON or SSE)

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{model}], POST /tokenize,
POST /detokenize; GET /health/live (200 while the process serves), GET /health/ready and its
older name GET /health (200 while a request can be served: a prefill and a decode worker up, or
a colocated one; 503 otherwise), GET /workers (each worker's state as the router sees it). The
/v1 routes and /tokenize, /detokenize need `Authorization: Bearer <key>` when a key is set.

No field is silently ignored: a request field that is not implemented is a 400 naming it, unless
it cannot change the answer (router_svc/openai_requests.py). More
routes (e.g. /metrics) go in through `HttpServer(..., routes=[...])` or `HttpServer.app` before
start().

Status codes, as the gRPC API maps the same errors (one table, api_errors.py): 400
InvalidArgument (param = the OpenAI name of the field), 404 unknown model, 429 Overloaded (with
Retry-After), 503 no worker can take it, 504 deadline; `code` is the gRPC ErrorInfo reason in
lower case. The response status is decided on the first step of the Frontend's stream, which
is where validation, admission and worker selection fail; an error after that ends an SSE
stream with one `data: {"error": ...}` event.

A client that goes away ends its request: the Frontend's generator is closed (the workers
cancel their legs), whether it was waiting for the first token, streaming, or being collected
for a non-streaming answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import logging
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import h11
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match
from uvicorn.protocols.http.h11_impl import H11Protocol

import tandem
from tandem.engine.sampling_params import SamplingParams
from tandem.errors import InvalidArgument
from tandem.router_svc import chat_request, prompt_batch, responses_api
from tandem.router_svc import openai_requests as req
from tandem.router_svc.frontend import Frontend, ModelNotFound
from tandem.router_svc.http_errors import (
    ApiError,
    api_error,
    body_error,
    error_response,
    http_error,
    internal_error,
    refuse,
    refuse_unknown,
)
from tandem.router_svc.http_guard import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_READ_TIMEOUT_S,
    ApiKeyAuth,
    BodyGuard,
)
from tandem.router_svc.openai_objects import (
    ChatShaper,
    CompletionShaper,
    Shaper,
    Step,
    StreamExtras,
)
from tandem.router_svc.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tandem.router_svc.responses_api import ResponsesRequest, ResponsesShaper, ResponseStore, Stored
from tandem.router_svc.workers import WorkerSet
from tandem.runtime.request_trace import ApiCall
from tandem.runtime.security import ApiKeys, PublicTls

log = logging.getLogger(__name__)

T = TypeVar("T")


def _api_call(request: Request, stream: bool | None,
              messages: list[dict[str, Any]] | None = None) -> ApiCall:
    """What the trace records of an HTTP request: streaming or not, the address the client
    used (its Host header), the chat messages (recorded only with --trace-content), and the
    trace it belongs to (_trace_parent)."""
    return ApiCall(stream=bool(stream), server_address=request.url.hostname,
                   server_port=request.url.port,
                   messages=tuple(messages) if messages is not None else None,
                   parent=_trace_parent(request))


def _trace_parent(request: Request) -> otel_context.Context:
    """The trace an HTTP request's spans join: the span the server stack made for the request
    when there is one (an ASGI instrumentation a deployment adds, or a framework version that
    traces requests itself: its span and the router's in one trace), else the caller's W3C
    traceparent, continued when it sent one (the router's span is then the request's server
    span). Never one trace per layer, whatever the versions installed."""
    if trace.get_current_span().get_span_context().is_valid:
        return otel_context.get_current()
    return propagate.extract(request.headers)


def _validation_error(frontend: Frontend) -> Callable[[Request, Exception],
                                                      Awaitable[JSONResponse]]:
    """FastAPI's request-body errors in OpenAI's shape; a generation request refused so is
    traced and logged as one."""
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        error = body_error(exc)
        path = request.url.path
        if path in ("/v1/completions", "/v1/chat/completions"):
            chat = path.endswith("chat/completions")
            frontend.refused(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", error,
                             _api_call(request, None), "chat" if chat else "text_completion")
        return error.response()

    return handle


def _extras(body: CompletionRequest | ChatCompletionRequest) -> StreamExtras:
    opts = body.stream_options
    tier = "default" if (body.model_extra or {}).get("service_tier") is not None else None
    return StreamExtras(bool(opts and opts.continuous_usage_stats),
                        bool(opts and opts.include_obfuscation), tier)


def _tenant(request: Request) -> str:
    return getattr(request.state, "tenant", "")


# -- request -> engine -------------------------------------------------------------------------
class _ClientGone(Exception):
    pass


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, aw: Awaitable[T]) -> T:
    """`aw`'s result; if the client goes away first, `aw` is cancelled and _ClientGone raised.
    (FastAPI does not cancel a handler whose client left.)"""
    task = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise _ClientGone
    return task.result()


class _ClosingStreamingResponse(StreamingResponse):
    """Closes its body iterator however the response ends. Starlette cancels the sending task
    when the client disconnects; if that happens while the iterator is parked at a `yield`,
    nothing else would close it (and so the Frontend's stream) until garbage collection."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


# -- the app -----------------------------------------------------------------------------------
class Shutdown:
    """The requests in flight, which the server ends (`end`) once its grace period to drain is
    over: each gets an answer, a 503, or for a stream an error event and then [DONE], where the
    server would otherwise cancel it mid-body (the client seeing a cut connection, the log a
    traceback)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()
        self.ending = False

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Around a request's wait for its workers; once ending, it ends at once."""
        if self.ending:
            raise asyncio.CancelledError
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            yield
        finally:
            self._tasks.discard(task)

    def end(self) -> None:
        self.ending = True
        for task in list(self._tasks):
            task.cancel()

    def ended_by_it(self) -> bool:
        """In an `except CancelledError`: whether end() cancelled the request (then answer it;
        its task goes on, uncancelled)."""
        task = asyncio.current_task()
        if not self.ending or task is None:
            return False
        task.uncancel()
        return True

    @staticmethod
    def error() -> ApiError:
        return ApiError(503, "the server is shutting down and its grace period to finish "
                        "requests ended", "service_unavailable", code="shutting_down")


class OpenAIApi:
    def __init__(self, frontend: Frontend, workers: WorkerSet,
                 shutdown: Shutdown | None = None,
                 responses_store: ResponseStore | None = None) -> None:
        self.frontend = frontend
        self.workers = workers
        self.shutdown = shutdown or Shutdown()
        self.stored = responses_store if responses_store is not None else ResponseStore()

    def routes(self) -> APIRouter:
        r = APIRouter()
        r.add_api_route("/v1/completions", self.completions, methods=["POST"])
        r.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        r.add_api_route("/v1/responses", self.responses, methods=["POST"])
        r.add_api_route("/v1/responses/{response_id}", self.get_response, methods=["GET"])
        r.add_api_route("/v1/models", self.list_models, methods=["GET"])
        r.add_api_route("/v1/models/{model:path}", self.get_model, methods=["GET"])
        r.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        r.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        r.add_api_route("/health", self.ready, methods=["GET"])
        r.add_api_route("/health/ready", self.ready, methods=["GET"])
        r.add_api_route("/health/live", self.live, methods=["GET"])
        r.add_api_route("/workers", self.worker_states, methods=["GET"])
        r.add_api_route("/version", self.version, methods=["GET"])
        return r

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        fe = self.frontend
        names: dict[str, str] = {}
        try:
            self._check_model(body.model)
            refuse_unknown(body)
            names["response_format"] = req.format_field(body)
            refuse(body.suffix, "suffix", "is not supported")
            fe.check_chars(req.prompt_chars(body.prompt))  # before the tokenizer runs
            prompts = await fe.run_off_loop(req.completion_prompts, fe, body.prompt)
            params = [self._completion_params(body, p, _tenant(request)) for p in prompts]
            refuse(body.best_of is not None and body.best_of != params[0].n, "best_of",
                   "is only supported equal to n")
            for p, q in zip(prompts, params):  # n and the rest before anything is sized by them
                await fe.check(p, q)
            echo = [req.echo_text(fe, g, p) if body.echo else ""
                    for g, p in zip(req.given_prompts(body.prompt), prompts)]
        except (InvalidArgument, ApiError) as e:
            error = api_error(e, names)
            fe.refused(f"cmpl-{uuid.uuid4().hex}", error, _api_call(request, body.stream),
                       "text_completion")
            return error.response()
        n = params[0].n
        shaper = CompletionShaper(fe.tokenizer, f"cmpl-{uuid.uuid4().hex}", fe.model.id,
                                  n * len(prompts), body.logprobs is not None, body.stream,
                                  self._include_usage(body), _extras(body), echo=echo,
                                  prompts=prompts, per_prompt=n,
                                  prompt_logprobs=body.prompt_logprobs is not None)
        api = _api_call(request, body.stream)
        if len(prompts) == 1:
            gen = fe.stream(shaper.id, prompts[0], params[0], api=api)
        else:
            gen = prompt_batch.merged([fe.stream(f"{shaper.id}-{i}", p, q, api=api)
                                       for i, (p, q) in enumerate(zip(prompts, params))], n)
        return await self._respond(request, body.stream, shaper, gen, names)

    def _completion_params(self, body: CompletionRequest, prompt: list[int],
                           tenant: str) -> SamplingParams:
        fe = self.frontend
        # Unset: the engine's default; null: whatever the context leaves (as vLLM).
        max_tokens = body.max_tokens if body.max_tokens is not None or \
            "max_tokens" not in body.model_fields_set else req.remaining(fe, prompt)
        params = fe.for_tenant(req.sampling_params(body, max_tokens, body.logprobs,
                                                   req.request_format(body)), tenant)
        if body.echo and body.logprobs is not None:  # the prompt's tokens lead them
            params = dataclasses.replace(params, prompt_logprobs=max(
                params.prompt_logprobs or 0, body.logprobs))
        return params

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        fe = self.frontend
        max_name = "max_completion_tokens" if body.max_completion_tokens is not None \
            else "max_tokens"
        names = {"prompt": "messages", "logprobs": "top_logprobs", "max_tokens": max_name,
                 "response_format": req.format_field(body)}
        try:
            self._check_model(body.model)
            refuse_unknown(body)
            fe.check_chars(req.messages_chars(body.messages), "messages")
            plan = await fe.run_off_loop(req.chat_plan, fe, body, names)
            plan = dataclasses.replace(plan, params=fe.for_tenant(plan.params, _tenant(request)))
            await fe.check(plan.prompt, plan.params)
        except (InvalidArgument, ApiError) as e:
            error = api_error(e, names)
            fe.refused(f"chatcmpl-{uuid.uuid4().hex}", error, _api_call(request, body.stream))
            return error.response()
        shaper = ChatShaper(fe.tokenizer, f"chatcmpl-{uuid.uuid4().hex}", fe.model.id,
                             plan.params.n, body.logprobs, body.stream,
                             self._include_usage(body), _extras(body), output=plan.output,
                             prompt=plan.prompt,
                             prompt_logprobs=plan.params.prompt_logprobs is not None)
        gen = fe.stream(shaper.id, plan.prompt, plan.params,
                        api=_api_call(request, body.stream, body.messages))
        return await self._respond(request, body.stream, shaper, gen, names)

    async def responses(self, body: ResponsesRequest, request: Request) -> Response:
        """The Responses API over the chat path (router_svc/responses_api.py)."""
        fe = self.frontend
        rid, tenant = f"resp_{uuid.uuid4().hex}", _tenant(request)
        names = dict(responses_api.NAMES)
        try:
            self._check_model(body.model)
            refuse_unknown(body)
            earlier: list[dict[str, Any]] = []
            if body.previous_response_id is not None:
                stored = self.stored.get(body.previous_response_id, tenant)
                if stored is None:
                    raise InvalidArgument("previous_response_id", f"no response "
                                          f"{body.previous_response_id!r} is stored here")
                earlier = stored.conversation
            conversation = earlier + responses_api.input_messages(body.input)
            chat = responses_api.chat_request(body, conversation)
            fe.check_chars(req.messages_chars(chat.messages), "input")
            plan = await fe.run_off_loop(req.chat_plan, fe, chat, names)
            plan = dataclasses.replace(plan, params=fe.for_tenant(plan.params, tenant))
            await fe.check(plan.prompt, plan.params)
        except (InvalidArgument, ApiError) as e:
            error = api_error(e, names)
            fe.refused(rid, error, _api_call(request, body.stream), "chat")
            return error.response()

        def keep(response: dict[str, Any]) -> None:
            if body.store:
                self.stored.put(rid, Stored(tenant, conversation +
                                            responses_api.output_messages(response), response))

        shaper = ResponsesShaper(fe.tokenizer, rid, fe.model.id, body.stream, plan,
                                 responses_api.echo_fields(body), keep)
        gen = fe.stream(rid, plan.prompt, plan.params, operation="chat",
                        api=_api_call(request, body.stream, chat.messages))
        return await self._respond(request, body.stream, shaper, gen, names)

    async def get_response(self, response_id: str, request: Request) -> Response:
        stored = self.stored.get(response_id, _tenant(request))
        if stored is None:
            return responses_api.not_found(response_id).response()
        return JSONResponse(stored.response)

    async def list_models(self) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    async def get_model(self, model: str) -> Response:
        try:
            self._check_model(model)
        except ApiError as e:
            return e.response()
        return JSONResponse(self._model_card())

    async def tokenize(self, body: TokenizeRequest) -> Response:
        fe = self.frontend
        try:
            self._check_model(body.model)
            refuse(fe.tokenizer is None, "prompt", "this model has no tokenizer")
            refuse((body.prompt is None) == (body.messages is None), "prompt",
                    "give a prompt or messages")
            if body.messages is not None:
                fe.check_chars(req.messages_chars(body.messages), "messages")
                tools = body.tools if chat_request.parse_tools(body.tools) else None
                ids, _ = await fe.run_off_loop(lambda: req.chat_prompt(
                    fe, body.messages, tools, body.chat_template_kwargs,
                    body.add_generation_prompt))
            else:
                fe.check_chars(len(body.prompt or ""))
                ids = await fe.run_off_loop(fe.tokenizer.encode, body.prompt or "",
                                            body.add_special_tokens)
        except (InvalidArgument, ApiError) as e:
            return api_error(e).response()
        out: dict[str, Any] = {"count": len(ids), "max_model_len": fe.model.max_model_len,
                               "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = await fe.run_off_loop(fe.tokenizer.convert_ids_to_tokens, ids)
        return JSONResponse(out)

    async def detokenize(self, body: DetokenizeRequest) -> Response:
        fe = self.frontend
        try:
            self._check_model(body.model)
            refuse(fe.tokenizer is None, "tokens", "this model has no tokenizer")
            vocab = fe.model.vocab_size
            bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
            refuse(bad is not None, "tokens", f"token id {bad} is outside [0, {vocab})")
        except ApiError as e:
            return e.response()
        return JSONResponse({"prompt": await fe.run_off_loop(fe.tokenizer.decode, body.tokens)})

    async def ready(self) -> Response:
        """Readiness: a request can be served now (at least one path through the workers)."""
        ok = self.workers.ready()
        return JSONResponse({"status": "ok" if ok else "unavailable"},
                            status_code=200 if ok else 503)

    async def version(self) -> Response:
        """The server's version (vLLM's /version; gRPC GetVersion)."""
        return JSONResponse({"version": tandem.__version__})

    async def live(self) -> Response:
        """Liveness: the process serves (it answered). Never depends on the workers."""
        return JSONResponse({"status": "ok"})

    async def worker_states(self) -> Response:
        ws = self.workers
        return JSONResponse({"ready": ws.ready(), "all_up": ws.all_healthy(),
                             "workers": ws.states()})

    # -- helpers ---------------------------------------------------------------------------------
    def _check_model(self, name: str | None) -> None:
        try:
            self.frontend.check_model(name)
        except ModelNotFound as e:
            raise api_error(e) from None

    def _model_card(self) -> dict:
        m = self.frontend.model
        return {"id": m.id, "object": "model", "created": 0, "owned_by": "tandem",
                "max_model_len": m.max_model_len}

    @staticmethod
    def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
        return bool(body.stream_options and body.stream_options.include_usage)

    async def _respond(self, request: Request, stream: bool, shaper: Shaper,
                       gen: AsyncIterator[Step], names: dict[str, str]) -> Response:
        """Run the request (`gen`: its Frontend stream, not started). The status code is
        settled by the first step: validation, admission and the choice of workers all happen
        before it."""
        try:
            with self.shutdown.track():
                if not stream:
                    await _unless_disconnected(request, self._collect(gen, shaper))
                    return JSONResponse(shaper.final())
                first = await _unless_disconnected(request, anext(gen, None))
        except _ClientGone:
            await gen.aclose()
            return Response(status_code=499)  # nobody is listening
        except Exception as e:  # noqa: BLE001
            await gen.aclose()
            return api_error(e, names).response()
        except asyncio.CancelledError:
            if not self.shutdown.ended_by_it():
                raise
            await gen.aclose()
            return self.shutdown.error().response()
        finally:
            if not stream:
                await gen.aclose()
        return _ClosingStreamingResponse(self._events(gen, first, shaper, names),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache",
                                                  "X-Accel-Buffering": "no"})

    @staticmethod
    async def _collect(gen: AsyncIterator[Step], shaper: Shaper) -> None:
        async for step in gen:
            shaper.add(step)

    async def _events(self, gen: AsyncIterator[Step], first: Step | None, shaper: Shaper,
                      names: dict[str, str]) -> AsyncIterator[str]:
        try:
            for c in shaper.start():
                yield shaper.sse(c)
            step = first
            while step is not None:
                for c in shaper.add(step):
                    yield shaper.sse(c)
                with self.shutdown.track():
                    step = await anext(gen, None)
            for c in shaper.end():
                yield shaper.sse(c)
        except Exception as e:  # noqa: BLE001 - mid-stream: the status line is long gone
            for c in shaper.failed(api_error(e, names)):
                yield shaper.sse(c)
        except asyncio.CancelledError:
            if not self.shutdown.ended_by_it():
                raise
            for c in shaper.failed(self.shutdown.error(), ended=True):
                yield shaper.sse(c)
        finally:
            await gen.aclose()  # type: ignore[attr-defined]


def _framework_telemetry_off() -> dict[str, Any]:
    """FastAPI's keyword that turns its own request telemetry off, in the versions that have
    it (a SERVER span per request, and OTLP metrics and logs, whenever a global tracer provider
    is set); none in those that do not. The router's span is the request's server span on
    every version, so that the trace reads the same whichever is installed."""
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    return {}


def _auth_refused(frontend: Frontend) -> Callable[[dict[str, Any]], None]:
    """Trace and log a request refused for its API key (HTTP 401), as every refusal is: a
    completion or chat request as a GenAI span of its operation, any other path as a span of
    its own; each with error.type UNAUTHENTICATED and one log line."""
    def refused(scope: dict[str, Any]) -> None:
        request = Request(scope)
        error = ApiError(401, "missing or incorrect API key", code="invalid_api_key")
        path = scope["path"]
        if path in ("/v1/completions", "/v1/chat/completions"):
            chat = path.endswith("chat/completions")
            frontend.refused(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", error,
                             _api_call(request, None), "chat" if chat else "text_completion")
        else:
            frontend.refused_call(f"{scope['method']} {path}", error,
                                  _api_call(request, None))

    return refused


def build_app(frontend: Frontend, workers: WorkerSet, api_keys: ApiKeys | None = None,
              routes: Sequence[BaseRoute] = (),
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              shutdown: Shutdown | None = None,
              responses_store: ResponseStore | None = None) -> FastAPI:
    app = FastAPI(title="Tandem OpenAI-compatible API", docs_url=None, redoc_url=None,
                  openapi_url=None, **_framework_telemetry_off())
    app.include_router(OpenAIApi(frontend, workers, shutdown, responses_store).routes())
    app.router.routes.extend(routes)
    app.add_exception_handler(RequestValidationError, _validation_error(frontend))
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    # Added last runs first: the key is checked before a byte of the body is read, then the
    # body is bounded and checked before the framework parses it.
    app.add_middleware(BodyGuard, max_bytes=max_body_bytes, respond=error_response,
                       takes_body=_takes_body(app),
                       limits=req.body_limits(frontend.model.max_model_len))
    if api_keys:
        app.add_middleware(ApiKeyAuth, keys=api_keys, on_refused=_auth_refused(frontend))
    return app


SHUTDOWN_BACKSTOP_S = 5.0


def _takes_body(app: FastAPI) -> Callable[[dict], bool]:
    """Whether a request is a POST to one of `app`'s routes (routes added after build_app
    included): the only requests whose body is ever read."""
    def takes_body(scope: dict) -> bool:
        return scope["method"] == "POST" and any(
            route.matches(scope)[0] is Match.FULL for route in app.router.routes)
    return takes_body


class RequestDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on receiving each request: its line, headers
    and body must all be in within `timeout_s` of its first byte (of the connection, for the
    first request). Past it the connection is closed, with a 408 when the headers were in and
    no answer has started; a handler waiting for the body sees the client leave. uvicorn times
    only the idle gap between requests, so a client sending its head or body a byte at a time,
    or never finishing it, would otherwise hold its connection and its reader for good.

    Built on uvicorn's own protocol (its `conn`, `cycle`, `transport` and `loop`)."""

    def __init__(self, *args: Any, timeout_s: float = DEFAULT_READ_TIMEOUT_S,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_s = timeout_s
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
            self._disarm()  # the whole request is in
        else:
            self._arm()  # a request is arriving: from its first byte on, if not already

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_started:
            with contextlib.suppress(h11.LocalProtocolError):  # no request line yet: just close
                for event in (h11.Response(status_code=408, reason=b"Request Timeout",
                                           headers=[(b"connection", b"close"),
                                                    (b"content-length", b"0")]),
                              h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
        self.transport.close()


class _Server(uvicorn.Server):
    """uvicorn in a loop it does not own: the router handles SIGTERM/SIGINT itself."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


class HttpServer:
    """Serves the OpenAI API in the running event loop. `app` is the FastAPI application; mount
    more on it (or pass `routes`) before start()."""

    def __init__(self, frontend: Frontend, workers: WorkerSet, host: str, port: int,
                 api_keys: ApiKeys | None = None, *, routes: Sequence[BaseRoute] = (),
                 grace_s: float = 5.0, tls: PublicTls | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
                 responses_store: ResponseStore | None = None,
                 sock: socket.socket | None = None) -> None:
        """`sock`: a bound socket to listen on instead of host:port (one other processes
        share: `tandem router --api-processes`)."""
        self._sock = sock
        self._shutdown = Shutdown()
        self._grace_s = grace_s
        self.app = build_app(frontend, workers, api_keys, routes, max_body_bytes,
                             self._shutdown, responses_store)
        ssl = {"ssl_certfile": str(tls.cert), "ssl_keyfile": str(tls.key)} if tls else {}
        self._server = _Server(uvicorn.Config(
            self.app, host=host, port=port, lifespan="off", access_log=False,
            http=functools.partial(RequestDeadline, timeout_s=read_timeout_s),  # type: ignore[arg-type]
            log_config=None,  # leave the process's logging as the router set it up
            # stop() ends what is open when grace_s is over; uvicorn's own cancel (a cut
            # connection, a traceback) is only the backstop for what did not end then.
            timeout_graceful_shutdown=grace_s + SHUTDOWN_BACKSTOP_S, **ssl))
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        """Listen; returns the bound port (the real one when port 0 was asked for)."""
        self._task = asyncio.create_task(self._server.serve(
            sockets=[self._sock] if self._sock is not None else None), name="http-server")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("HTTP server exited before it started listening")
            await asyncio.sleep(0.01)
        return self._server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop accepting, let open responses finish for up to grace_s, then end them: a 503,
        or for a stream an error event and [DONE] (Shutdown)."""
        if self._task is None:
            return
        self._server.should_exit = True
        done, _ = await asyncio.wait({self._task}, timeout=self._grace_s)
        if not done:
            self._shutdown.end()
        await self._task
        self._task = None

