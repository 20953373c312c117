"""The engine loop: schedule → run → postprocess. Synchronous and single-threaded; the offline
LLM drives it directly, the services from their engine core process (engine/serving).

Roles share this one engine:
  both     prefill and decode here;
  prefill  a request ends after its first token(s): its blocks stay pinned under a lease and
           the output carries a Handoff (block ids, first tokens) for a decode worker;
  decode   `add_remote_request` admits a request whose prompt KV lives on a prefill worker; the
           engine keeps the prompt's full blocks its own prefix cache holds, allocates blocks
           for the rest, has its puller copy only those in, and decodes; a request moved here
           with no prefill worker to hand its KV over (`add_replayed_request`) is prefilled
           here, then its tokens the client has are recorded, not sampled, and it decodes on.
The engine owns the objects that hold each part's state: the prefill and decode halves of that
handoff (`kv_connector`, its role's: engine/kv_connector.py), the pipelined steps (`pipeline`:
engine/async_step.py) and speculative decoding (`spec`: engine/spec_decode/, None when off);
this file holds the loop and the requests' outputs, which every role shares.

Pipelined steps (`async_scheduling`, on by default on CUDA; engine/async_step.py): `step()` schedules
and launches step N+1 while the device runs step N (N+1's placeholder ids filled on the device
from N's sampled tokens), then waits for N's tokens and returns N's outputs, one call later
than a synchronous step. A step runs synchronously, exactly as without the flag (the step in
flight resolved first, its finished sequences dropped from the batch), in role prefill, with
tensor parallelism, and when its batch has a KV pull outside the device's stream order (NIXL),
a preemption, or a sequence with penalties, logprobs, samples still to fork (n > 1), drafts
to verify or tokens to replay (a step in flight is resolved for drafts only when one is
expected: Speculator.expects_draft). A step with a grammar row takes step N's tokens after launching
its forward pass and before its sampling (the mask needs them).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch

from tandem.engine import prompt_logprobs
from tandem.engine.async_step import PLACEHOLDER, StepPipeline
from tandem.engine.block_pool import BlockPool
from tandem.engine.config import EngineConfig, ModelConfig
from tandem.engine.grammar import GrammarCompiler
from tandem.engine.kv_connector import PullDone, connector_for
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.migration import Migrations, Resumed, Tokens
from tandem.engine.model_runner import ModelRunner, PoolFactory
from tandem.engine.model_source import resolve_model
from tandem.engine.sampler import SampleRow
from tandem.engine.sampling_params import RequestLimits, SamplingParams
from tandem.engine.scheduler import ScheduledBatch, Scheduler
from tandem.engine.sequence import (
    FinishReason,
    Handoff,
    Lent,
    RemoteKV,
    Replay,
    SeqOutput,
    Sequence,
    Status,
    StepResult,
    StepStats,
    StopCheck,
)
from tandem.engine.shared_host_tier import fingerprint, tier_for
from tandem.engine.spec_decode.draft import DraftProposer, DraftSetup
from tandem.engine.spec_decode.speculator import Speculator
from tandem.errors import InvalidArgument
from tandem.kvtransfer.lease import prefix_digest

log = logging.getLogger(__name__)

# With nothing else to run, how long a step waits for a grammar being compiled.
COMPILE_WAIT_S = 0.05
# How long an engine with nothing to run but pulls in flight waits before looking again.
PULL_POLL_S = 1e-4


class LLMEngine:
    def __init__(self, config: EngineConfig, *, pool_factory: PoolFactory | None = None,
                 progress: bool = True, tp_options: dict | None = None) -> None:
        keep_freed_memory()
        self.config = config
        self.model_dir = resolve_model(config.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        cache = config.cache_config()
        sched = config.scheduler_config(self.model_config)
        # Speculative decoding (engine/spec_decode/); never in role prefill (first tokens only).
        # A draft model loads first: the model's KV pool is sized from what it leaves.
        spec = config.speculative_config() if config.role != "prefill" else None
        draft = (DraftProposer.load(spec, self._draft_setup(config, sched))
                 if spec is not None and spec.method == "draft" else None)
        # Tensor parallelism: ranks 1.. in processes of their own, this one is rank 0.
        self.tp_group = None
        if config.tensor_parallel_size > 1:
            from tandem.engine.tp_group import start_tp_group  # noqa: PLC0415 - tensor parallelism only

            self.tp_group = start_tp_group(config, self.model_dir, self.model_config, tp_options)
        try:
            self.runner = self._runner(config, cache, sched, pool_factory, progress)
        except BaseException:
            if self.tp_group is not None:
                self.tp_group.kill()
            raise
        self.runner.peers = self.tp_group
        self.block_pool = BlockPool(self.runner.num_blocks, cache.block_size,
                                    cache.enable_prefix_caching)
        # Host-memory tier under the prefix cache (engine/host_kv_tier.py); None when off.
        pool = self.runner.pool
        self.host_tier = tier_for(
            pool, config.host_kv_cache_gb, enabled=config.host_tier_enabled(),
            share=config.host_kv_share, ranks=config.tensor_parallel_size,
            fp=fingerprint(os.path.realpath(self.model_dir), tuple(pool.shape[1:]),
                           str(pool.dtype), config.kv_cache_dtype))
        if self.host_tier is not None:
            if self.tp_group is not None:
                self.tp_group.open_host_tier(self.host_tier)
            log.info("host KV tier: %.1f GiB taken in %.1f s",
                     self.host_tier.capacity_bytes / (1 << 30), self.host_tier.wait_for_memory())
        self.kv = KVCacheManager(self.block_pool, self.host_tier)
        # A sequence can never outgrow the whole pool.
        max_len = min(sched.max_model_len, self.runner.num_blocks * cache.block_size)
        self.scheduler = Scheduler(dataclasses.replace(sched, max_model_len=max_len), self.kv)
        self.max_model_len = max_len
        self.limits = RequestLimits(self.model_config.vocab_size, max_len, config.max_n)
        self.stops = StopCheck(frozenset(self.model_config.eos_token_ids), max_len)
        self.spec = Speculator.build(spec, draft) if spec is not None else None
        # Structured outputs; loads the tokenizer and xgrammar only when a grammar arrives.
        self.grammars = GrammarCompiler(self.model_dir, self.model_config.vocab_size,
                                        list(self.eos_token_ids))
        # Requests held back until their grammar is compiled (in arrival order).
        self.compiling: list[tuple[Sequence, Future]] = []
        # The handoff, as this role sees it: the prefill role's leases, the decode role's pulls.
        self.kv_connector = connector_for(config.role, self.block_pool, cache.block_size,
                                          self.model_config.vocab_size, max_len)
        # Live migration between decode workers: what this engine lends, what it waits for.
        self.migrations = Migrations(self.kv_connector, cache.block_size)
        # Outputs made between steps (a HandOver that failed its request), sent with the next.
        self.deferred: list[SeqOutput] = []
        self.pipeline = StepPipeline(self.runner, self.scheduler, self.stops, self._finish,
                                     enabled=self._pipelined(config))
        self.requests: dict[str, list[Sequence]] = {}
        self.num_requests_added = 0
        # The step() call's: its wall time, the batch it scheduled and ran or launched, and
        # the tokens it returned (pipelined: those of the step launched by the call before).
        self.last_step: StepStats | None = None
        # Of last_step.seconds, the model runner's execute (0 with no batch); pipelined, its
        # launches plus the wait for the previous step's tokens: the rest is host work.
        self.last_execute_s = 0.0
        # Observer, when set: called at the end of every step with the step's outputs, after
        # last_step and last_execute_s are set, on the caller's thread and outside the step's
        # timing. How benchmarks/serving/offline.py reads per-step facts while LLM.generate runs.
        self.on_step: Callable[[list[SeqOutput]], None] | None = None

    def _runner(self, config: EngineConfig, cache, sched, pool_factory, progress: bool
                ) -> ModelRunner:
        return ModelRunner(
            self.model_config, cache, device=config.device, dtype=config.dtype,
            model_dir=self.model_dir, load_format=config.load_format, seed=config.seed,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_model_len=sched.max_model_len, max_num_seqs=sched.max_num_seqs,
            cuda_graphs=config.cuda_graphs, mixed_cuda_graphs=config.mixed_cuda_graphs,
            pool_factory=pool_factory, progress=progress,
            kv_cache_dtype_name=config.kv_cache_dtype, quantization=config.quantization,
            tp=self.tp_group.state if self.tp_group is not None else None)

    def _draft_setup(self, config: EngineConfig, sched) -> DraftSetup:
        return DraftSetup(config.device, config.dtype, config.load_format, config.seed,
                          config.block_size, config.cpu_kv_bytes, config.cuda_graphs,
                          sched.max_num_batched_tokens, sched.max_model_len, self.model_dir,
                          self.model_config.vocab_size)

    def _pipelined(self, config: EngineConfig) -> bool:
        """Whether steps may be pipelined: on (by default on CUDA), not in role prefill (its
        requests end at their first token), not under tensor parallelism (each step is
        broadcast to the other ranks as host lists)."""
        on = config.async_scheduling
        if on is None:
            on = self.runner.device.type == "cuda"
        return on and config.role != "prefill" and self.tp_group is None

    # -- requests ----------------------------------------------------------------------------
    def validate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        """Every check that can fail before a block is allocated."""
        if not request_id:
            raise InvalidArgument("request_id", "must be non-empty")
        if request_id in self.requests:
            raise InvalidArgument("request_id", f"{request_id!r} is already in use")
        # A response format's grammar is built on the compile thread (_admit), never here on
        # the step loop: a schema can take seconds to convert. A schema that cannot be built
        # ends its request with the error; the router and LLM.generate refuse it before.
        self.limits.check(prompt_token_ids, params, ids_field="prompt_token_ids")

    def _admit(self, seq: Sequence) -> None:
        """To the scheduler, or, while its grammar compiles (off this thread), held back."""
        fmt = seq.params.response_format
        if fmt is not None:
            fut = self.grammars.submit(fmt)
            if not fut.done() or fut.exception() is not None:
                self.compiling.append((seq, fut))
                return
            # The matcher starts fresh: a decode request's first tokens advance it on arrival.
            seq.grammar = self.grammars.state_of(fut.result())
        self.scheduler.add(seq)

    def _grammars_ready(self) -> list[SeqOutput]:
        """Held-back requests whose grammar is compiled join the scheduler; one whose grammar
        failed ends with the error. With nothing else to run, wait briefly for a compile."""
        if not self.scheduler.has_work() and self.pipeline.inflight is None:
            wait([f for _, f in self.compiling], COMPILE_WAIT_S, FIRST_COMPLETED)
        outputs, still = [], []
        for seq, fut in self.compiling:
            if seq.is_finished:  # aborted while compiling
                continue
            if not fut.done():
                still.append((seq, fut))
            elif (err := fut.exception()) is not None:
                self._finish(seq, FinishReason.ERROR)
                out = self._output(seq, [], [])
                out.error = str(err)
                outputs.append(out)
            else:
                seq.grammar = self.grammars.state_of(fut.result())
                self.scheduler.add(seq)
        self.compiling = still
        return outputs

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        self.validate(request_id, prompt_token_ids, params)
        self._add(Sequence(request_id, prompt_token_ids, params))

    def add_remote_request(self, request_id: str, prompt_token_ids: list[int],
                           params: SamplingParams, remote: RemoteKV) -> None:
        """Decode role: the prompt's KV and first token(s) come from a prefill worker. Any
        role, `remote.prefix`: the KV of the prompt's leading blocks comes from another
        worker's cache; the rest is computed here."""
        self.validate(request_id, prompt_token_ids, params)
        if remote.prefix:
            self.kv_connector.check_prefix(prompt_token_ids, params, remote)
        else:
            self.kv_connector.check(prompt_token_ids, params, remote)
        seq = Sequence(request_id, prompt_token_ids, params)
        seq.remote = remote
        self._add(seq)

    def add_replayed_request(self, request_id: str, prompt_token_ids: list[int],
                             params: SamplingParams, replay: Replay) -> None:
        """A request moved here with the tokens its client has, prefilled here: its prompt is
        computed in chunks, then each sample's tokens are recorded (not sampled) and it
        decodes on from there, at the same sample indices and output positions."""
        self.validate(request_id, prompt_token_ids, params)
        self.kv_connector.check_outputs(prompt_token_ids, params, replay)
        seq = Sequence(request_id, prompt_token_ids, params)
        seq.replay = replay
        self._add(seq)

    def _add(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = [seq]
        self._admit(seq)
        self.num_requests_added += 1

    def abort(self, request_id: str) -> bool:
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return False
        for seq in seqs:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT)
        self.scheduler.remove_finished()
        return True

    def fail(self, request_ids: Iterable[str], message: str) -> list[SeqOutput]:
        """End these requests with an error: each of their unfinished samples gets a last
        output that carries it."""
        outputs = []
        for rid in request_ids:
            for seq in self.requests.pop(rid, ()):
                if not seq.is_finished:
                    self._finish(seq, FinishReason.ERROR)
                    out = self._output(seq, [], [])
                    out.error = message
                    outputs.append(out)
        self.scheduler.remove_finished()
        return outputs

    def stop_sequence(self, request_id: str, sample_index: int) -> None:
        """Finish one sample early (its text hit a stop string); siblings go on."""
        for seq in self.requests.get(request_id, ()):
            if seq.sample_index == sample_index and not seq.is_finished:
                self._finish(seq, FinishReason.STOP)
        self.scheduler.remove_finished()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do at TP 1); leave a shared host
        tier."""
        if self.host_tier is not None:
            self.host_tier.close()
        if self.tp_group is not None:
            self.tp_group.close(before_destroy=self.runner.close)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.stops.eos_token_ids

    def has_work(self) -> bool:
        return (self.scheduler.has_work() or bool(self.compiling) or bool(self.deferred)
                or self.pipeline.inflight is not None)

    def is_idle(self) -> bool:
        return (not self.requests and not len(self.kv_connector)
                and self.block_pool.is_idle() and (self.spec is None or self.spec.is_idle()))

    def switch_role(self, role: str) -> None:
        """Serve `role` (prefill or decode, from the other) from the next step on, keeping what
        is costly to make: the model, its compiled kernels and CUDA graphs, the KV pool with
        its prefix cache, the host tier. What a role decides is remade: its handoff (a
        prefill's leases or a decode's pulls: a new, empty connector), the waiting queue's
        order and whether steps are pipelined. Only while idle (a drained worker); refused
        with speculative decoding, whose proposer a prefill engine never loads."""
        if {role, self.config.role} != {"prefill", "decode"}:
            raise InvalidArgument("role", f"a {self.config.role} engine cannot serve {role!r}: "
                                  "only prefill and decode engines trade roles")
        if self.config.speculative_method is not None:
            raise InvalidArgument("role", "an engine with speculative decoding does not "
                                  "change role (a prefill engine loads no proposer)")
        if not self.is_idle() or self.has_work() or self.migrations.busy():
            raise RuntimeError("the engine is not idle: a role changes between requests only")
        self.config = dataclasses.replace(self.config, role=role)
        self.scheduler.reconfigure(self.config.scheduler_config(self.model_config))
        self.kv_connector = connector_for(role, self.block_pool, self.block_pool.block_size,
                                          self.model_config.vocab_size, self.max_model_len)
        self.migrations.connector = self.kv_connector
        self.pipeline.enabled = self._pipelined(self.config)

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[SeqOutput]:
        t0 = time.perf_counter()
        # A request moved here live: its switch is timed, from the HandOver to its first token.
        timed = time.monotonic() if self.migrations.resumed else 0.0
        connector = self.kv_connector
        if len(connector):
            connector.expire()
        outputs = self._grammars_ready() if self.compiling else []
        if self.deferred:
            outputs, self.deferred = self.deferred + outputs, []
        if connector.waiting:
            outputs += self._poll_pulls()
        ran: list[StepResult] = []
        if self.spec is not None:
            ran += self._speculate()
        batch = self.scheduler.schedule()
        for seq in batch.unpulled:  # a lent prefix its own caches hold: the lease goes back
            connector.drop(seq)
        if self.host_tier is not None:  # its copies, before anything writes these blocks
            self.host_tier.flush(wait=not connector.ordered(batch.pulls))
        pipe = self.pipeline
        pipelined = (bool(batch.seqs) and pipe.enabled and pipe.can_launch(batch)
                     and connector.ordered(batch.pulls))
        prev = pipe.take_inflight()
        if prev is not None and not pipelined:  # synchronous: the step in flight first
            ran.append(pipe.resolve(prev))
            batch.drop_finished()
            prev = None
        outputs += self._pulled(connector.start(batch.pulls))
        if batch.seqs:
            try:
                ran.append(pipe.launch(batch, prev) if pipelined else self._run(batch))
            except Exception:  # fails this step's requests, not the others
                # One forward pass for the whole batch: nothing tells which request broke it,
                # so the batch's requests fail; those waiting or preempted go on.
                log.exception("engine step failed; failing the %d requests in it",
                              len({s.request_id for s in batch.seqs}))
                ran.append(StepResult(self.fail(dict.fromkeys(s.request_id for s in batch.seqs),
                                                "internal error in the engine step")))
        if prev is not None:  # pipelined: step N+1 is launched, now step N's tokens
            ran.append(pipe.resolve(prev))
        for r in ran:
            outputs += r.outputs
        if connector.waiting:  # the step in flight resolved: a pull waiting on it may start
            outputs += self._poll_pulls(idle=not batch.seqs)
        self.scheduler.remove_finished()
        if timed and self.migrations.resumed:
            self._time_resumed(batch, timed, outputs)
        self.last_execute_s = sum(r.execute_s for r in ran)
        self.last_step = StepStats(len(batch.seqs), batch.num_tokens, batch.num_decodes,
                                   len(batch.preempted), time.perf_counter() - t0,
                                   sum(r.num_sampled for r in ran),
                                   sum(r.num_prompt_tokens for r in ran))
        if self.on_step is not None:
            self.on_step(outputs)
        return outputs

    def _speculate(self) -> list[StepResult]:
        """Drafts for this step's decodes (engine/spec_decode/). They continue each
        sequence's last token, so a pipelined step in flight is resolved first, unless no
        sequence may get a draft in this step (the batch too large, every sequence opted
        out or paused for low acceptance) or none is expected to (the proposer's guess from
        the tokens known): then the step stays pipelined, without drafts."""
        ran = []
        spec, running = self.spec, self.scheduler.running
        wanted = spec.begin_step(running, bool(self.scheduler.waiting))
        if (wanted and self.pipeline.inflight is not None
                and spec.expects_draft(running, self.max_model_len)):
            ran.append(self.pipeline.resolve(self.pipeline.take_inflight()))
            self.scheduler.remove_finished()
        spec.propose(self.scheduler.running, self.max_model_len)  # finished ones dropped
        return ran

    def _run(self, batch: ScheduledBatch) -> StepResult:
        """One synchronous step: its outputs, tokens sampled, and prompt tokens of the
        sequences sampling their first."""
        rows: list[SampleRow] = []
        row_index: list[int] = []
        samplers: list[Sequence] = []
        replays: list[Sequence] = []  # prompts computed here whose outputs the client has
        offset = 0
        penalties = any(s.params.has_penalties for s in batch.seqs)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            offset += n
            if seq.spec_token_ids:  # a verify row: one row per position (spec_decode/)
                samplers.append(seq)
                rows += self.spec.rows(seq, penalties)
                row_index += range(offset - n, offset)
                continue
            if seq.num_computed_tokens + n < seq.num_tokens:
                continue  # a prefill chunk that does not reach the end samples nothing
            if seq.replay is not None:
                replays.append(seq)
                continue
            samplers.append(seq)
            for k in range(seq.num_samples):
                rows.append(SampleRow(
                    seq.params, seq.sample_index + k, seq.num_output_tokens,
                    seq.token_ids[:seq.num_prompt_tokens] if penalties else None,
                    seq.output_token_ids if penalties else None, seq.grammar))
                row_index.append(offset - 1)
        now = started = time.monotonic()
        for seq in batch.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        prompt = prompt_logprobs.rows(batch)
        t = time.perf_counter()
        result = self.runner.execute(batch, rows, row_index + prompt.token_index)
        execute_s = time.perf_counter() - t
        if result.extra_logits is not None:
            prompt_logprobs.record(prompt, result.extra_logits)
        now = time.monotonic()
        num_prompt_tokens = 0
        for seq in samplers:
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.num_tokens == seq.num_prompt_tokens:
                num_prompt_tokens += seq.num_prompt_tokens

        self.scheduler.advance(batch, started, now)
        outputs: list[SeqOutput] = []
        for seq in replays:
            replay, seq.replay = seq.replay, None
            outputs += self._start_decoding(seq, replay)
        r = 0
        for seq in samplers:
            if seq.spec_token_ids:
                k = 1 + len(seq.spec_token_ids)
                outputs.append(self._verified(seq, result.token_ids[r:r + k],
                                              result.logprobs[r:r + k]))
                r += k
                continue
            k = seq.num_samples
            toks, lps = result.token_ids[r:r + k], result.logprobs[r:r + k]
            r += k
            if self.config.role == "prefill":
                outputs.append(self._handoff(seq, toks, lps))
                continue
            children = self._fork(seq, toks[1:], lps[1:])
            for s, tok, lp in zip([seq, *children], toks, lps):
                outputs.append(self._append(s, tok, lp))
        return StepResult(outputs, len(rows), num_prompt_tokens, execute_s)

    def _verified(self, seq: Sequence, tokens: list[int], lps: list) -> SeqOutput:
        """A verify row's tokens kept (engine/spec_decode/speculator.py), each appended and
        checked for a stop as a one-token step's is; then the sequence's computed length is
        its tokens but the last (whose KV the next step writes) and rejected drafts' blocks go
        back to the pool."""
        m = self.spec.accept(seq, tokens)
        kept, kept_lps = [], []
        for tok, lp in zip(tokens[:m], lps[:m]):
            if self._take(seq, tok, lp):
                kept.append(tok)
                kept_lps.append(lp)
            if seq.is_finished:
                return self._output(seq, kept, kept_lps)
        self.kv.rewind(seq, seq.num_tokens - 1)
        self.kv.cache_full_blocks(seq)
        return self._output(seq, kept, kept_lps)

    def _fork(self, parent: Sequence, tokens: list[int], lps: list) -> list[Sequence]:
        if not tokens:
            return []
        parent.pending_forks = 0
        children = [self.kv.fork(parent, parent.sample_index + 1 + i) for i in range(len(tokens))]
        self.requests[parent.request_id].extend(children)
        self.scheduler.insert_after(parent, children)
        return children

    def _append(self, seq: Sequence, token: int, lp, sampled_here: bool = True) -> SeqOutput:
        """The token taken (`_take`), as the sample's output."""
        if self._take(seq, token, lp, sampled_here):
            return self._output(seq, [token], [lp])
        return self._output(seq, [], [])

    def _take(self, seq: Sequence, token: int, lp, sampled_here: bool = True) -> bool:
        """Append a sampled token and check it for a stop; False if it was not kept.
        `sampled_here`: the token was sampled under this sequence's grammar mask (its
        matcher takes it during the next step's fill); else it is checked now."""
        if seq.grammar is not None and sampled_here:
            seq.grammar.defer(token)
        elif seq.grammar is not None and not seq.grammar.accept(token):
            # Only a token sampled from a row with nothing allowed (or a first token from a
            # prefill worker that broke the grammar) gets here: end the sample without it.
            log.warning("%s#%d: token %d breaks its grammar; ending the sample",
                        seq.request_id, seq.sample_index, token)
            self._finish(seq, FinishReason.STOP)
            return False
        seq.token_ids.append(token)
        seq.logprobs.append(lp)
        reason = self.stops(seq.params, token, seq.num_output_tokens, seq.num_tokens)
        if reason is not None:
            self._finish(seq, reason)
        return True

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        while seq.token_ids and seq.token_ids[-1] == PLACEHOLDER:  # a step in flight's
            seq.token_ids.pop()
        self.kv_connector.drop(seq)
        if self.migrations.parked or self.migrations.early or self.migrations.resumed:
            self.migrations.forget(seq.request_id)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.monotonic()
        self.kv.free(seq)
        self.runner.release(seq.seq_id)
        if self.spec is not None:
            self.spec.release(seq)
        seqs = self.requests.get(seq.request_id)
        if seqs is not None and all(s.is_finished for s in seqs) and not seq.pending_forks:
            del self.requests[seq.request_id]

    def _output(self, seq: Sequence, tokens: list[int], lps: list) -> SeqOutput:
        return SeqOutput(seq.request_id, seq.sample_index, tokens, lps, seq.finish_reason,
                         seq.num_prompt_tokens, seq.num_cached_tokens, seq.num_output_tokens,
                         timing=seq.timing() if seq.finish_reason is not None else None,
                         prompt_logprobs=prompt_logprobs.take(seq))

    # -- the handoff's halves ----------------------------------------------------------------
    def _handoff(self, seq: Sequence, tokens: list[int], lps: list) -> SeqOutput:
        """Prefill role: pin the prompt's blocks under a lease and end the request here."""
        now = time.monotonic()
        lease, ttl = self.kv_connector.hold(seq.block_ids, now)
        reasons = []
        for tok in tokens:
            seq.token_ids.append(tok)  # as the decode side will see it
            reasons.append(self.stops(seq.params, tok, seq.num_output_tokens, seq.num_tokens))
            seq.token_ids.pop()
        handoff = Handoff(tuple(seq.block_ids), seq.num_tokens, tuple(tokens), tuple(lps),
                          lease, ttl, tuple(reasons), seq.num_cached_tokens, now + ttl)
        seq.block_ids = []  # now owned by the lease
        seq.pending_forks = 0
        self._finish(seq, FinishReason.HANDOFF)
        out = self._output(seq, [], [])
        out.handoff = handoff
        return out

    def _poll_pulls(self, idle: bool = False) -> list[SeqOutput]:
        """Decode role: start decoding the requests whose pull is done; fail those whose pull
        failed. `idle`: nothing else to run, so wait a little for one instead of spinning."""
        outputs = self._pulled(self.kv_connector.poll())
        if idle and self.kv_connector.waiting and not outputs:
            time.sleep(PULL_POLL_S)
        return outputs

    def _pulled(self, done: list[PullDone]) -> list[SeqOutput]:
        outputs = []
        for seq, remote, error in done:
            if remote.prefix:  # a lent prefix: pulled, or computed here after all
                self._prefix_pulled(seq, remote, error)
                continue
            if error is not None:
                outputs += self.fail([seq.request_id], error)
                continue
            try:
                if remote.handover:  # a running sequence moving here: wait for the switch
                    outputs += self._park(seq, remote)
                    continue
                outputs += self._start_decoding(seq, remote)
            except Exception:  # this request's own state: it fails alone
                log.exception("request %s failed after its KV pull", seq.request_id)
                outputs += self.fail([seq.request_id], "internal error after the KV pull")
        return outputs

    def _prefix_pulled(self, seq: Sequence, remote: RemoteKV, error: str | None) -> None:
        """A lent prefix's pull ended. Done: its tokens count as computed (and as cached, as
        a host tier's restores do) and its blocks join the prefix cache; the next steps compute
        the rest of the prompt. Failed (its lender gone, the lease run out): the blocks it was
        to fill are computed instead, from the first one this pool did not hold."""
        if error is None:
            seq.num_computed_tokens = seq.num_cached_tokens = remote.num_tokens
            self.kv.cache_full_blocks(seq)
            return
        log.warning("request %s: the lent prefix could not be pulled (%s); computing it",
                    seq.request_id, error)
        seq.num_computed_tokens = seq.num_cached_tokens

    def _start_decoding(self, seq: Sequence, remote: RemoteKV | Replay) -> list[SeqOutput]:
        """A pulled (or replayed) request's prompt is computed; its first token(s) came with
        the handoff, and after a move from another decode worker each sample's outputs
        since."""
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.kv.cache_full_blocks(seq)
        firsts, lps = remote.first_token_ids, remote.first_logprobs
        resume = remote.resume_token_ids or ((),) * len(firsts)
        children = self._fork(seq, list(firsts[1:]), list(lps[1:]))
        outputs = []
        for s, tok, lp, more in zip([seq, *children], firsts, lps, resume):
            # These went to the client already: record (grammar and stop checks included), do
            # not re-emit. The tokens after the prompt have no KV here yet: the next steps
            # compute them as a prompt chunk, then sample the next one.
            self._append(s, tok, lp, sampled_here=False)
            for t in more:
                if s.is_finished:
                    break
                self._append(s, t, None, sampled_here=False)
            if s.is_finished:  # a sample that had finished before the move
                outputs.append(self._output(s, [], []))
        if outputs:
            # Finished here, outside the step's end: out of the running list now, or the
            # next schedule() would give the finished sample blocks nothing frees (a HandOver
            # arrives between steps; a pull polled at a step's start is scheduled next).
            self.scheduler.remove_finished()
        return outputs

    # -- a cached prefix lent to another worker -------------------------------------------------
    def lend_prefix(self, token_ids: list[int], cache_salt: str = "") -> Lent | None:
        """A lease on the longest prefix of `token_ids` (whole blocks, keyed under
        `cache_salt`) that this engine's pool caches or its host tier holds, for a worker of
        another host to pull instead of computing it (the tier's blocks are copied back into
        the pool first, and those copies are done when this returns); None when it holds none
        or its pool has no room to restore them. The lease pins the blocks as a prefill
        lease does, until its Release or expiry. On CUDA it waits for the device: a pipelined
        step in flight may be writing a lent block."""
        bs = self.block_pool.block_size
        seq = Sequence("", token_ids[:len(token_ids) // bs * bs],
                       SamplingParams(cache_salt=cache_salt))
        blocks = self.kv.take_prefix(seq.full_block_hashes(bs, seq.num_tokens),
                                     self.scheduler.watermark if self.scheduler.running else 0)
        if not blocks:
            return None
        if self.host_tier is not None:  # the restores' copies (and any offloads they caused)
            self.host_tier.flush(wait=True)
        pool = self.runner.pool
        if pool.is_cuda:  # a peer reads the blocks outside the engine's streams: a step in
            torch.cuda.synchronize(pool.device)  # flight writing one, a restore, are done
        now = time.monotonic()
        lease_id, ttl = self.kv_connector.hold(blocks, now)
        n = len(blocks) * bs
        return Lent(lease_id, tuple(blocks), n, prefix_digest(token_ids[:n], cache_salt),
                    now + ttl)

    # -- live migration (engine/migration.py) ---------------------------------------------------
    def lend(self, request_id: str) -> Lent | None:
        """Source: a lease on a running request's KV for another decode worker to pull while
        this one decodes on; None when it has none to lend (it moves by token replay)."""
        seqs = self.requests.get(request_id)
        if not seqs:
            return None
        return self.migrations.lend(seqs, self.pipeline.inflight is not None)

    def hand_over(self, request_id: str, tokens: Tokens, received: float = 0.0) -> None:
        """Destination: the source stopped the request; `tokens`, per sample, are those it
        made since the request was sent here. Recorded, and it decodes on. `received`: when
        its worker got the HandOver (time.monotonic()), for the switch's timing log."""
        known = request_id in self.requests
        got = self.migrations.take(request_id, tokens, known)
        if known:
            self.migrations.resumed.setdefault(request_id, Resumed()).received = (
                received or time.monotonic())
        if got is not None:
            self.deferred += self._resume_moved(*got, tokens)

    def _time_resumed(self, batch: ScheduledBatch, started: float,
                      outputs: list[SeqOutput]) -> None:
        """The switch's timing of requests handed over here (engine/migration.py Resumed):
        the step that computes a tail, then the first token, logged once per request."""
        resumed = self.migrations.resumed
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            r = resumed.get(seq.request_id)
            if r is not None and r.applied and not r.scheduled:
                r.scheduled, r.tail_tokens = started, n
                r.decode_rows = n > 1 and self.runner.last_decode_rows
        for r in resumed.values():
            r.steps += bool(r.applied)
        now = time.monotonic()
        for o in outputs:
            r = resumed.get(o.request_id)
            if r is None or not r.applied or not o.new_token_ids:
                continue
            del resumed[o.request_id]
            r.first_token = now
            log.info("moved request %s: first token here %.2f ms after its HandOver reached "
                     "this worker (tail of %d tokens as %s) %s", o.request_id,
                     (now - (r.received or r.applied)) * 1e3, r.tail_tokens,
                     "decode rows" if r.decode_rows else "a chunk", r.log_fields())

    def _park(self, seq: Sequence, remote: RemoteKV) -> list[SeqOutput]:
        """A moving request's KV is pulled: out of the batch until its HandOver."""
        self.scheduler.running.remove(seq)
        early = self.migrations.park(seq, remote)
        return [] if early is None else self._resume_moved(seq, remote, early)

    def _resume_moved(self, seq: Sequence, remote: RemoteKV, tokens: Tokens) -> list[SeqOutput]:
        """Its tokens recorded as a move's are (the client has them), the KV of those past
        the lease's recomputed by the next steps, then it samples on."""
        before = remote.resume_token_ids or ((),) * len(remote.first_token_ids)
        if len(tokens) != len(before):
            return self.fail([seq.request_id], f"handover: {len(tokens)} samples, expected "
                             f"{len(before)}")
        remote = dataclasses.replace(remote, resume_token_ids=tuple(
            b + tuple(t) for b, t in zip(before, tokens)))
        try:
            self.kv_connector.check_outputs(seq.token_ids[:seq.num_prompt_tokens], seq.params,
                                            remote)
        except InvalidArgument as e:
            return self.fail([seq.request_id], str(e))
        self.scheduler.running.append(seq)
        self.migrations.resumed.setdefault(seq.request_id, Resumed()).applied = time.monotonic()
        outputs = self._start_decoding(seq, remote)
        if remote.num_tokens > seq.num_prompt_tokens and not seq.is_finished:
            seq.num_computed_tokens = remote.num_tokens  # the outputs' KV came too
            self.kv.cache_full_blocks(seq)
        return outputs

    # -- stats -------------------------------------------------------------------------------
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self.compiling)

    def num_running(self) -> int:
        return len(self.scheduler.running)


def keep_freed_memory() -> None:
    """glibc: keep freed memory in the process (up to 512 MiB of it; blocks under 32 MiB from
    the heap, not from mmap). Process-wide, set once an engine exists. Every step allocates and
    frees the same temporaries; with glibc's defaults they go back to the OS and the next step
    faults the pages in again. Elsewhere than glibc, nothing."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: fixed (glibc's maximum), not adjusted on the fly
    mallopt(-1, 512 << 20)  # M_TRIM_THRESHOLD
