"""The engine loop: schedule → run → postprocess. Synchronous and single-threaded; the offline
LLM drives it directly, the services from their engine core process (engine/serving).

Roles share this one engine:
  both     prefill and decode here;
  prefill  a request ends after its first token(s): its blocks stay pinned under a lease and
           the output carries a Handoff (block ids, first tokens) for a decode worker;
  decode   `add_remote_request` admits a request whose prompt KV lives on a prefill worker; the
           engine keeps the prompt's full blocks its own prefix cache holds, allocates blocks
           for the rest, calls `kv_puller` to copy only those in, and decodes.
The prefill and decode halves of that handoff are engine/kv_handoff.py's (a mixin); this file
holds the loop and what every role shares.

Pipelined steps (`async_scheduling`, on by default on CUDA; engine/async_step.py): `step()` schedules
and launches step N+1 while the device runs step N (N+1's placeholder ids filled on the device
from N's sampled tokens), then waits for N's tokens and returns N's outputs, one call later
than a synchronous step. A step runs synchronously, exactly as without the flag (the step in
flight resolved first, its finished sequences dropped from the batch), in role prefill, with
tensor parallelism, and when its batch has a KV pull outside the device's stream order (NIXL),
a preemption, or a sequence with penalties, logprobs or samples still to fork (n > 1). A step with a grammar row takes step N's
tokens after launching its forward pass and before its sampling (the mask needs them).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait

from engine.async_step import PLACEHOLDER, InFlight, PipelinedSteps
from engine.block_pool import BlockPool
from engine.config import EngineConfig, ModelConfig
from engine.grammar import GrammarCompiler
from engine.kv_handoff import KVDropper, KVHandoff, KVPuller
from engine.kv_manager import KVCacheManager
from engine.model_runner import ModelRunner, PoolFactory
from engine.model_source import resolve_model
from engine.sampler import SampleRow
from engine.sampling_params import RequestLimits, SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import FinishReason, RemoteKV, SeqOutput, Sequence, Status, StepStats
from kvtransfer.lease import LeaseTable
from tandem.errors import InvalidArgument

log = logging.getLogger(__name__)

# With nothing else to run, how long a step waits for a grammar being compiled.
COMPILE_WAIT_S = 0.05


class LLMEngine(KVHandoff, PipelinedSteps):
    def __init__(self, config: EngineConfig, *, pool_factory: PoolFactory | None = None,
                 kv_puller: KVPuller | None = None, kv_dropper: KVDropper | None = None,
                 progress: bool = True, tp_options: dict | None = None) -> None:
        keep_freed_memory()
        self.config = config
        self.model_dir = resolve_model(config.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        cache = config.cache_config()
        sched = config.scheduler_config(self.model_config)
        # Tensor parallelism: ranks 1.. in processes of their own, this one is rank 0.
        self.tp_group = None
        if config.tensor_parallel_size > 1:
            from engine.tp_group import start_tp_group  # noqa: PLC0415 - tensor parallelism only

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
        self.kv = KVCacheManager(self.block_pool)
        # A sequence can never outgrow the whole pool.
        max_len = min(sched.max_model_len, self.runner.num_blocks * cache.block_size)
        self.scheduler = Scheduler(dataclasses.replace(sched, max_model_len=max_len), self.kv)
        self.max_model_len = max_len
        self.limits = RequestLimits(self.model_config.vocab_size, max_len, config.max_n)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        # Structured outputs; loads the tokenizer and xgrammar only when a grammar arrives.
        self.grammars = GrammarCompiler(self.model_dir, self.model_config.vocab_size,
                                        list(self.eos_token_ids))
        # Requests held back until their grammar is compiled (in arrival order).
        self.compiling: list[tuple[Sequence, Future]] = []
        self.leases = LeaseTable()
        self.lease_ttl_s = 30.0
        self.lease_max_life_s: float | None = None
        self.kv_puller = kv_puller
        # Whether a request's pull is ordered with the steps on the device (pipelined steps go
        # on beside it); None: no pull is (engine/async_step.py).
        self.kv_pull_in_stream: Callable[[RemoteKV], bool] | None = None
        self.kv_dropper = kv_dropper
        # Sequences (and their KV's source) whose pull completes outside the stream (NIXL)
        self.pulling: list[tuple[Sequence, RemoteKV]] = []
        self.requests: dict[str, list[Sequence]] = {}
        self.num_requests_added = 0
        self.num_prompt_tokens_computed = 0  # prompt tokens run through the model, all told
        self.inflight: InFlight | None = None  # a pipelined step launched, tokens unknown
        # The step() call's: its wall time, the batch it scheduled and ran or launched, and
        # the tokens it returned (pipelined: those of the step launched by the call before).
        self.last_step: StepStats | None = None
        # Of last_step.seconds, the model runner's execute (0 with no batch); pipelined, its
        # launches plus the wait for the previous step's tokens: the rest is host work.
        self.last_execute_s = 0.0
        # Observer, when set: called at the end of every step with the step's outputs, after
        # last_step and last_execute_s are set, on the caller's thread and outside the step's
        # timing. How benchmarks/offline.py reads per-step facts while LLM.generate runs.
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
        if not self.scheduler.has_work() and self.inflight is None:
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
        seq = Sequence(request_id, prompt_token_ids, params)
        self.requests[request_id] = [seq]
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
        """Stop the other tensor-parallel ranks (nothing to do at TP 1)."""
        if self.tp_group is not None:
            self.tp_group.close(before_destroy=self.runner.close)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.compiling) or self.inflight is not None

    def is_idle(self) -> bool:
        return not self.requests and not len(self.leases) and self.block_pool.is_idle()

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[SeqOutput]:
        t0 = time.perf_counter()
        self.last_execute_s = 0.0
        if len(self.leases):
            self.expire_leases()
        outputs = self._grammars_ready() if self.compiling else []
        if self.pulling:
            outputs += self._poll_pulls()
        batch = self.scheduler.schedule()
        pipelined = bool(batch.seqs) and self._pipeline_enabled() and self._can_pipeline(batch)
        prev, self.inflight = self.inflight, None
        ran: list[tuple[list[SeqOutput], int, int]] = []  # outputs, sampled, prompt tokens
        if prev is not None and not pipelined:  # synchronous: the step in flight first
            ran.append(self._resolve(prev))
            self._drop_finished(batch)
            prev = None
        outputs += self._pull(batch.pulls)
        if batch.seqs:
            try:
                ran.append(self._launch(batch, prev) if pipelined else self._run(batch))
            except Exception:  # fails this step's requests, not the others
                # One forward pass for the whole batch: nothing tells which request broke it,
                # so the batch's requests fail; those waiting or preempted go on.
                log.exception("engine step failed; failing the %d requests in it",
                              len({s.request_id for s in batch.seqs}))
                ran.append((self.fail(dict.fromkeys(s.request_id for s in batch.seqs),
                                      "internal error in the engine step"), 0, 0))
        if prev is not None:  # pipelined: step N+1 is launched, now step N's tokens
            ran.append(self._resolve(prev))
        for outs, _, _ in ran:
            outputs += outs
        if self.pulling:  # the step in flight resolved: a pull waiting on it may start
            outputs += self._poll_pulls(idle=not batch.seqs)
        self.scheduler.remove_finished()
        self.last_step = StepStats(len(batch.seqs), batch.num_tokens, batch.num_decodes,
                                   len(batch.preempted), time.perf_counter() - t0,
                                   sum(r[1] for r in ran), sum(r[2] for r in ran))
        if self.on_step is not None:
            self.on_step(outputs)
        return outputs

    def _run(self, batch: ScheduledBatch) -> tuple[list[SeqOutput], int, int]:
        """Outputs, tokens sampled, and prompt tokens of the sequences sampling their first."""
        rows: list[SampleRow] = []
        row_index: list[int] = []
        samplers: list[Sequence] = []
        offset = 0
        penalties = any(s.params.has_penalties for s in batch.seqs)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            offset += n
            if seq.num_computed_tokens + n < seq.num_tokens:
                continue  # a prefill chunk that does not reach the end samples nothing
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
        t = time.perf_counter()
        result = self.runner.execute(batch, rows, row_index)
        self.last_execute_s += time.perf_counter() - t
        now = time.monotonic()
        num_prompt_tokens = 0
        for seq in samplers:
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.num_tokens == seq.num_prompt_tokens:
                num_prompt_tokens += seq.num_prompt_tokens

        self._advance(batch, started, now)
        outputs: list[SeqOutput] = []
        r = 0
        for seq in samplers:
            k = seq.num_samples
            toks, lps = result.token_ids[r:r + k], result.logprobs[r:r + k]
            r += k
            if self.config.role == "prefill":
                outputs.append(self._handoff(seq, toks, lps))
                continue
            children = self._fork(seq, toks[1:], lps[1:])
            for s, tok, lp in zip([seq, *children], toks, lps):
                outputs.append(self._append(s, tok, lp))
        return outputs, len(rows), num_prompt_tokens

    def _advance(self, batch: ScheduledBatch, started: float, now: float,
                 fed: set[int] | frozenset[int] = frozenset()) -> None:
        """After a step ran (or was launched): prefill chunks recorded, tokens computed, and
        the prefix cache's blocks just filled hashed, except those of sequences in `fed` (fed
        a placeholder: hashed once its token is known, engine/async_step.py)."""
        bs = self.block_pool.block_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                seq.num_prefill_chunks += 1
                k = min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
                seq.prefill_chunks.append((started, now, k))
                self.num_prompt_tokens_computed += k
            seq.num_computed_tokens += n
            if seq.seq_id not in fed and seq.num_computed_tokens // bs > seq.num_cached_blocks:
                self.kv.cache_full_blocks(seq)

    def _fork(self, parent: Sequence, tokens: list[int], lps: list) -> list[Sequence]:
        if not tokens:
            return []
        parent.pending_forks = 0
        children = [self.kv.fork(parent, parent.sample_index + 1 + i) for i in range(len(tokens))]
        self.requests[parent.request_id].extend(children)
        self.scheduler.insert_after(parent, children)
        return children

    def _append(self, seq: Sequence, token: int, lp, sampled_here: bool = True) -> SeqOutput:
        """`sampled_here`: the token was sampled under this sequence's grammar mask (its
        matcher takes it during the next step's fill); else it is checked now."""
        if seq.grammar is not None and sampled_here:
            seq.grammar.defer(token)
        elif seq.grammar is not None and not seq.grammar.accept(token):
            # Only a token sampled from a row with nothing allowed (or a first token from a
            # prefill worker that broke the grammar) gets here: end the sample without it.
            log.warning("%s#%d: token %d breaks its grammar; ending the sample",
                        seq.request_id, seq.sample_index, token)
            self._finish(seq, FinishReason.STOP)
            return self._output(seq, [], [])
        seq.token_ids.append(token)
        seq.logprobs.append(lp)
        reason = self._stop_reason(seq, token)
        if reason is not None:
            self._finish(seq, reason)
        return self._output(seq, [token], [lp])

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos):
            return FinishReason.STOP
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        while seq.token_ids and seq.token_ids[-1] == PLACEHOLDER:  # a step in flight's
            seq.token_ids.pop()
        self._drop_kv(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.monotonic()
        self.kv.free(seq)
        self.runner.release(seq.seq_id)
        seqs = self.requests.get(seq.request_id)
        if seqs is not None and all(s.is_finished for s in seqs) and not seq.pending_forks:
            del self.requests[seq.request_id]

    def _output(self, seq: Sequence, tokens: list[int], lps: list) -> SeqOutput:
        return SeqOutput(seq.request_id, seq.sample_index, tokens, lps, seq.finish_reason,
                         seq.num_prompt_tokens, seq.num_cached_tokens, seq.num_output_tokens,
                         timing=seq.timing() if seq.finish_reason is not None else None)

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
