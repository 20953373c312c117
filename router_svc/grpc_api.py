"""The public gRPC API, tandem.v1.Tandem: a thin servicer over the Frontend. Errors carry
google.rpc.Status details (api_errors.py)."""

from __future__ import annotations

from contextlib import aclosing

import tandem
from tandem.engine.grammar import check_strict
from tandem.errors import InvalidArgument, Overloaded
from tandem.router_svc import prompt_batch
from tandem.router_svc.api_errors import abort, end_call, failure_of, grpc_field
from tandem.router_svc.frontend import MAX_REQUEST_ID_CHARS, Frontend, ModelNotFound
from tandem.router_svc.orchestrator import RouterError
from tandem.runtime.convert import FORMAT_ONEOF, logprobs_to_proto, params_from_proto
from tandem.runtime.request_trace import ApiCall
from tandem.runtime.security import tenant_of
from tandem.v1 import api_pb2, api_pb2_grpc


class TandemServicer(api_pb2_grpc.TandemServicer):
    def __init__(self, frontend: Frontend, address: tuple[str, int] | None = None) -> None:
        self.frontend = frontend
        self.address = address  # where this API listens: server.address / server.port in traces

    async def Generate(self, request, context):  # noqa: N802 - gRPC method name
        fe = self.frontend
        rid = request.request_id or fe.new_request_id()  # what the caller sees
        tenant = tenant_of(context)
        # Inside the cluster a caller's own id is its tenant's; a random one is anyone's.
        scoped = fe.scoped_request_id(rid, tenant) if request.request_id else rid
        host, port = self.address or (None, None)
        api = ApiCall(stream=True, server_address=host, server_port=port)
        steps = None
        try:
            fe.check_model(request.model)
            if len(request.request_id) > MAX_REQUEST_ID_CHARS:
                raise InvalidArgument("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters")
            params = fe.for_tenant(params_from_proto(request.params), tenant)
            fmt = params.response_format
            if fmt is not None and fmt.type == "json_schema":  # always strict over gRPC
                check_strict(fmt.schema or "{}", "json_schema")
            prompts = await self._prompts(request)
            # aclosing: a cancelled call closes the request's legs at once.
            if len(prompts) == 1:
                steps = fe.stream(scoped, prompts[0], params, context.time_remaining(), api=api)
            else:
                steps = prompt_batch.merged(
                    [fe.stream(f"{scoped}-{i}", p, params, context.time_remaining(), api=api)
                     for i, p in enumerate(prompts)], params.n)
            with_prompt_lps: set[int] = set()  # the samples that carried them
            async with aclosing(steps):
                async for deltas, usage in steps:
                    u = api_pb2.Usage(prompt_tokens=usage.prompt_tokens,
                                      completion_tokens=usage.completion_tokens,
                                      cached_prompt_tokens=usage.cached_prompt_tokens)
                    for d in deltas:
                        # Once per prompt, on its first sample's first chunk (sample j of
                        # prompt i is index i * n + j; every sample's first step has them).
                        prompt_lps = d.prompt_logprobs if d.index % params.n == 0 and \
                            d.index not in with_prompt_lps else None
                        if prompt_lps is not None:
                            with_prompt_lps.add(d.index)
                        yield api_pb2.GenerateResponse(
                            request_id=rid, index=d.index, token_ids=d.token_ids, text=d.text,
                            logprobs=[logprobs_to_proto(lp) for lp in d.logprobs]
                            if params.logprobs is not None else [],
                            finish_reason=d.finish_reason or "",
                            stop_reason=d.stop_reason or "", usage=u,
                            prompt_logprobs=[logprobs_to_proto(lp) for lp in
                                             prompt_lps or ()])
        except (InvalidArgument, ModelNotFound, Overloaded, RouterError) as e:
            if steps is None:  # refused before the Frontend saw it: traced here
                fe.refused(scoped, e, api)
            f = failure_of(e)
            prompt_field = request.WhichOneof("prompt") or "prompt"
            fmt_field = request.params.WhichOneof(FORMAT_ONEOF)
            end_call(context, f, grpc_field(f.field, prompt_field, fmt_field) if f.field
                     else None)

    async def _prompts(self, request: api_pb2.GenerateRequest) -> list[list[int]]:
        """The request's prompt, or prompts, as token ids; each checked for its length before
        it is tokenized or copied."""
        which = request.WhichOneof("prompt")
        if which == "prompts":
            prompt_batch.check_count(len(request.prompts.prompts))
            given = list(request.prompts.prompts)
        else:
            given = [request]
        out = []
        for p in given:
            if p.WhichOneof("prompt" if which != "prompts" else "kind") == "text":
                self.frontend.check_chars(len(p.text))  # before the tokenizer: slow on MBs
                out.append(await self.frontend.run_off_loop(self.frontend.encode, p.text))
            else:  # a message under gRPC's 4 MB limit can hold 4M ids: counted before copied
                self.frontend.check_ids_count(len(p.token_ids.ids))
                out.append(list(p.token_ids.ids))
        return out

    async def ListModels(self, request, context):  # noqa: N802
        return api_pb2.ListModelsResponse(models=[self._info()])

    async def GetVersion(self, request, context):  # noqa: N802
        return api_pb2.GetVersionResponse(version=tandem.__version__)

    async def GetModelInfo(self, request, context):  # noqa: N802
        try:
            self.frontend.check_model(request.model)
        except ModelNotFound as e:
            await abort(context, failure_of(e))
        return self._info()

    async def Tokenize(self, request, context):  # noqa: N802
        tok = self.frontend.tokenizer
        try:
            if tok is None:
                raise InvalidArgument("input", "this model has no tokenizer")
            if request.WhichOneof("input") == "chat":
                msgs = [{"role": m.role, "content": m.content} for m in request.chat.messages]
                self.frontend.check_chars(sum(len(m["content"]) for m in msgs), "chat")
                ids = await self.frontend.run_off_loop(tok.apply_chat_template, msgs)
            else:
                self.frontend.check_chars(len(request.text), "text")
                ids = await self.frontend.run_off_loop(
                    tok.encode, request.text, request.add_special_tokens)
        except InvalidArgument as e:
            await abort(context, failure_of(e))
        return api_pb2.TokenizeResponse(token_ids=ids)

    def _info(self) -> api_pb2.ModelInfo:
        m = self.frontend.model
        workers = self.frontend.orchestrator.workers  # they run the model: their dtype is it
        return api_pb2.ModelInfo(id=m.id, architecture=m.architecture,
                                 max_model_len=m.max_model_len, vocab_size=m.vocab_size,
                                 dtype=workers.dtype or m.dtype, block_size=workers.block_size)
