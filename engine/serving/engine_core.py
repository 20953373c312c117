"""The engine core: the engine in a process of its own, driven over two pipes.

    worker process (gRPC, asyncio)                 engine core process
    ──────────────────────────────                 ───────────────────
    AsyncEngine ── commands: Add, Abort, ───────▶   input thread ─▶ queue
                   Release, MapPool, TakeSnapshot, main thread: commands between steps,
                   Stop                            step(), one Step event per step
                ◀── events: Reply, Step, Snapshot-
                    Changed, Aborted, LeaseDone

A worker's gRPC server and its engine loop used to share one interpreter lock: every message the
server built or read stalled the engine's step, and the step's many short torch calls kept
handing the lock to the server's threads (on a CPU worker, 10-20% of the engine's throughput).
Here each has an interpreter of its own; per step the core pays one pickled message.

The core owns everything that touches the model or the KV pool: the LLMEngine, its pool (a
prefill worker's, allocated here for peers to map), the peers' pools a decode worker maps, the
KV pulls, and the leases (a decode worker's: kv_pulls.py). It never builds a span or a metric: what the worker records comes to
it as events (step statistics, a pull's figures with its lease).

The messages both sides share are in core_messages.py.

Lifetime: the core ignores SIGINT and SIGTERM (its worker decides when it stops: "stop" or the
command pipe closing) and dies with its worker (PR_SET_PDEATHSIG), so a killed worker leaves no
engine holding memory or a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import queue
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from tandem.engine.heap import freeze_startup_heap
from tandem.engine.serving.core_messages import (
    Abort,
    Aborted,
    Add,
    Call,
    CoreInfo,
    CoreSpec,
    EngineSnapshot,
    Failed,
    HandOver,
    KVEvents,
    LeasesRenewed,
    Lend,
    LendPrefix,
    MapPool,
    Ready,
    Release,
    Renew,
    Reply,
    SnapshotChanged,
    Step,
    Stop,
    SwitchRole,
    TakeSnapshot,
    pack_outputs,
    portable,
)
from tandem.engine.serving.kv_pulls import KVPulls
from tandem.kvtransfer import transports

if TYPE_CHECKING:
    from tandem.engine.host_kv_tier import HostKVTier

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # how often an idle core looks at lease deadlines


class EngineCore:
    def __init__(self, spec: CoreSpec, events: Connection) -> None:
        from tandem.engine.llm_engine import LLMEngine  # noqa: PLC0415 - torch, in the core only

        self.spec = spec
        self.events = events
        self.pool: Any = None  # this core's pool, when peers map it (prefill)
        # Peers map a prefill pool (prompts' KV) and a decode pool (running sequences that
        # move to another decode worker: live migration).
        pool_factory = (self._allocate_shared_pool if spec.role in ("prefill", "decode")
                        else None)
        # Tensor parallelism: the other ranks share their own pools the same way (prefill).
        # How peers reach this core's pool (prefill), kvtransfer/transports.py's.
        self.transport = spec.transport or transports.default_for(spec.config.device)
        # Where this worker runs, for a transport that listens or dials itself; its lease
        # lookup reads its connector's lease table (made with the engine, after the pool).
        self.site = transports.WorkerSite(spec.host, spec.tls, lambda lease_id:
                                          self.engine.kv_connector.lease_blocks(lease_id))
        tp_options = {"pool_transport": self.transport if pool_factory else None}
        if spec.cpu_threads is not None:
            tp_options["cpu_threads"] = spec.cpu_threads
        # A rank that dies takes the core with it (its worker exits 1 and is restarted): the
        # engine cannot step without it, and its requests must not wait on a collective.
        tp_options["on_rank_exit"] = _rank_exited
        self.engine = LLMEngine(spec.config, pool_factory=pool_factory, progress=False,
                                tp_options=tp_options)
        # Rank 0's side of a handoff that moves heads between tensor-parallel sizes: used for
        # every peer when this worker has several ranks, or for a peer that has.
        from tandem.engine.tp_group import RankKV  # noqa: PLC0415 - torch, in the core only

        cfg = self.engine.model_config
        self.rank_kv = RankKV(tp_options["pool_transport"], 0,
                              spec.config.tensor_parallel_size, cfg.num_kv_heads)
        self.rank_kv.pool, self.rank_kv.local = self.pool, self.engine.runner.pool
        self.rank_pools: tuple = ()  # a prefill worker's ranks 1.. descriptors
        if self.pool is not None and self.engine.tp_group is not None:
            self.rank_pools = tuple(self.engine.tp_group.call(
                "describe", (), self.rank_kv.describe)[1:])
        # The peers' pools (a decode worker's prefill workers; any worker's lenders of a
        # cached prefix), the pulls from them, and the leases they settle.
        self.kv = KVPulls(self.engine, self.rank_kv, events, self.site)
        self._connect(self.engine.kv_connector)
        # The router routes on what this worker's prefix cache holds: record its changes.
        self.engine.block_pool.kv_events = {}
        if self.engine.host_tier is not None:  # ... and its host tier
            self.engine.host_tier.index.events = {}
        # Batches of calls, each what the pipe held when the input thread read it.
        self.commands: queue.SimpleQueue[list[Call]] = queue.SimpleQueue()
        self.handlers = {Add: self._add, Abort: self._abort, Release: self._release,
                         Renew: self._renew, LeasesRenewed: self.kv.renewed,
                         MapPool: self.kv.map, Lend: self._lend,
                         LendPrefix: self._lend_prefix, HandOver: self._hand_over,
                         TakeSnapshot: self._take_snapshot, SwitchRole: self._switch_role,
                         Stop: self._stop}
        self.wake = threading.Event()
        self.stopping = False
        self._last_snapshot: EngineSnapshot | None = None

    def _connect(self, connector: Any) -> None:
        """The role's handoff: a prefill or decode connector owns the leases it grants (their
        time to live is the role's), and every role pulls through this core's KVPulls (a
        decode worker from its prefill workers; any worker a prefix another one lent)."""
        if self.spec.role in ("prefill", "decode"):
            connector.ttl_s, connector.max_life_s = (self.spec.lease_ttl_s,
                                                     self.spec.lease_max_life_s)
        connector.connect(self.kv.pull, self.kv.drop, self.kv.in_stream)

    def info(self) -> CoreInfo:
        engine = self.engine
        runner, cfg = engine.runner, engine.model_config
        # The pool's own dtype ("float8_e4m3fn" with --kv-cache-dtype fp8), as torch names it.
        tp = self.spec.config.tensor_parallel_size
        layout = {"dtype": str(runner.kv_dtype).removeprefix("torch."),
                  "block_size": runner.block_size,
                  "num_layers": cfg.num_layers, "num_kv_heads": runner.num_kv_heads,
                  "head_dim": cfg.head_dim, "num_blocks": runner.num_blocks}
        if tp > 1:  # this rank's pool holds some of the model's heads
            layout.update(model_kv_heads=cfg.num_kv_heads, tensor_parallel_size=tp,
                          tensor_parallel_rank=0)
        pool = None
        if self.pool is not None:
            pool = self.rank_kv.describe() if tp > 1 else self.pool.descriptor
        tier_id = engine.host_tier.tier_id if engine.host_tier is not None else ""
        return CoreInfo(layout, os.getpid(), pool, engine.limits, self.rank_pools, tier_id)

    # -- the loop ----------------------------------------------------------------------------
    def serve(self, commands: Connection) -> None:
        threading.Thread(target=self._read, args=(commands,), name="core-input",
                         daemon=True).start()
        engine = self.engine
        while not self.stopping:
            self.wake.clear()
            while True:
                try:
                    batch = self.commands.get_nowait()
                except queue.Empty:
                    break
                for call in batch:
                    self._command(call)
            if self.stopping:
                break
            if not engine.has_work():
                self.kv.flush()  # the leases of the last in-stream pulls
                if len(engine.kv_connector):
                    engine.kv_connector.expire(time.monotonic())
                kv = self._kv_events()
                if kv is not None:
                    self.events.send(kv)
                self._send_snapshot_if_changed()
                self.wake.wait(IDLE_WAIT_S)
                continue
            try:  # a request's own failure in a step fails it alone (LLMEngine.step)
                outputs = engine.step()
                stats = engine.last_step
            except Exception:  # the engine's own state: nothing tells whose, all fail
                log.exception("engine step failed; failing every request")
                outputs = engine.fail(list(engine.requests), "internal error in the engine step")
                stats = None
            self.kv.poll()
            snap = self._snapshot()
            self._last_snapshot = snap
            plain, whole = pack_outputs(outputs)
            self.events.send(Step(plain, whole, stats, time.perf_counter(), snap,
                                  self._kv_events()))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.engine.shutdown()  # the other tensor-parallel ranks, if any
        with contextlib.suppress(Exception):
            self.rank_kv.close()
        self.pool = None if self.rank_kv.pool is self.pool else self.pool
        self.kv.close()
        if self.pool is not None:
            with contextlib.suppress(Exception):
                self.pool.close()

    def _read(self, commands: Connection) -> None:
        """Input thread: commands into the queue as they come, everything the pipe holds as one
        batch, so that the main thread takes commands sent together before its next step (a
        core stopped, then resumed, reads a request and the renewals of its lease that came
        meanwhile at once, not the request alone and a step that finds its lease expired); the
        pipe closing (the worker is gone) stops the core."""
        while True:
            batch = []
            try:
                batch.append(commands.recv())
                while commands.poll(0):
                    batch.append(commands.recv())
            except (EOFError, OSError):
                batch.append(Call(Stop()))
            self.commands.put(batch)
            self.wake.set()
            if isinstance(batch[-1].command, Stop):
                return

    def _command(self, call: Call) -> None:
        try:
            result = self.handlers[type(call.command)](call.command)
        except Exception as e:
            if call.call_id:
                self.events.send(Reply(call.call_id, None, portable(e)))
            else:
                log.exception("command %s failed", type(call.command).__name__)
            return
        if call.call_id:
            self.events.send(Reply(call.call_id, result))

    # -- commands ----------------------------------------------------------------------------
    def _add(self, cmd: Add) -> None:
        remote = cmd.remote
        if cmd.replay is not None:
            self.engine.add_replayed_request(cmd.request_id, cmd.prompt, cmd.params, cmd.replay)
            return
        if remote is None:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params)
            return
        self.kv.hold(remote, cmd.request_id)
        try:
            self.engine.add_remote_request(cmd.request_id, cmd.prompt, cmd.params, remote)
        except BaseException:
            self.kv.settle(remote)  # refused: nobody will pull it
            raise

    def _abort(self, cmd: Abort) -> bool:
        engine = self.engine
        unfinished = sum(1 for s in engine.requests.get(cmd.request_id, ()) if not s.is_finished)
        aborted = engine.abort(cmd.request_id)
        if aborted and unfinished:
            self.events.send(Aborted(unfinished))
        return aborted

    def _release(self, cmd: Release) -> bool:
        return self.engine.kv_connector.release(cmd.lease_id)

    def _renew(self, cmd: Renew) -> list[float]:
        return self.engine.kv_connector.renew(cmd.lease_ids)

    def _lend(self, cmd: Lend) -> Any:
        return self.engine.lend(cmd.request_id)

    def _lend_prefix(self, cmd: LendPrefix) -> Any:
        return self.engine.lend_prefix(list(cmd.token_ids), cmd.cache_salt)

    def _hand_over(self, cmd: HandOver) -> None:
        self.engine.hand_over(cmd.request_id, cmd.tokens, cmd.received)

    def _take_snapshot(self, _: TakeSnapshot) -> EngineSnapshot:
        return self._snapshot()

    def _switch_role(self, cmd: SwitchRole) -> None:
        """An idle engine serves the other role (a worker changing role in place): its
        handoff is remade and the peers' pools it mapped are closed; the model, the pool with
        its prefix cache, the host tier and this core's counters stay."""
        if self.kv.leases_held or self.kv.pulls:
            raise RuntimeError("KV pulls are under way: a role changes between requests only")
        self.engine.switch_role(cmd.role)  # refused unless idle: nothing changed then
        self.kv.close()
        self.kv.peers.clear()
        self.site = dataclasses.replace(self.site, tls=cmd.tls)
        self.kv.site = self.site
        self.spec = dataclasses.replace(self.spec, role=cmd.role, lease_ttl_s=cmd.lease_ttl_s,
                                        lease_max_life_s=cmd.lease_max_life_s, tls=cmd.tls)
        self._connect(self.engine.kv_connector)
        _name_native_thread(f"{cmd.role}-core")
        log.info("serving the %s role now", cmd.role)

    def _stop(self, _: Stop) -> None:
        self.stopping = True

    # -- helpers -----------------------------------------------------------------------------
    def _allocate_shared_pool(self, shape, dtype, device):
        from tandem.kvtransfer.pool import allocate_pool  # noqa: PLC0415 - torch, in the core only

        n, layers, _, bs, heads, dim = shape
        pool = allocate_pool(num_blocks=n, num_layers=layers, block_size=bs, num_kv_heads=heads,
                             head_dim=dim, dtype=dtype, device=device,
                             transport=self.transport, site=self.site)
        self.pool = pool
        return pool.tensor

    def _snapshot(self) -> EngineSnapshot:
        e = self.engine
        pool = e.block_pool
        spec = e.spec.counters if e.spec is not None else None
        backoff = e.spec.backoff.counters if e.spec is not None else None
        draft = e.spec.draft_pool if e.spec is not None else None
        return EngineSnapshot(e.num_running(), e.num_waiting(), pool.num_free, pool.num_blocks,
                              len(e.kv_connector), len(e.requests), e.num_requests_added,
                              pool.block_size, pool.prefix_queries, pool.prefix_hits,
                              e.scheduler.num_preemptions, e.scheduler.num_prompt_tokens_computed,
                              self.kv.blocks_pulled, self.kv.bytes_pulled,
                              self.kv.runs_pulled, self.kv.pull_seconds,
                              *((spec.num_draft_tokens, spec.num_accepted_tokens,
                                 tuple(spec.drafted_at), tuple(spec.accepted_at),
                                 backoff.num_pauses, backoff.num_paused_steps,
                                 *((draft.num_used, draft.num_blocks) if draft else ()))
                                if spec is not None else ()),
                              **_host_tier_fields(e.host_tier),
                              kv_blocks_migrated=self.kv.blocks_migrated,
                              migrations_in=self.kv.migrations_in,
                              migrations_lent=e.migrations.num_lent)

    def _kv_events(self) -> KVEvents | None:
        stored, removed = self.engine.block_pool.take_events()
        tier = self.engine.host_tier
        host_stored, host_removed = tier.index.take_events() if tier is not None else ([], [])
        if not (stored or removed or host_stored or host_removed):
            return None
        return KVEvents(stored, removed, host_stored, host_removed)

    def _send_snapshot_if_changed(self) -> None:
        snap = self._snapshot()
        if snap != self._last_snapshot:
            self._last_snapshot = snap
            self.events.send(SnapshotChanged(snap))


def _rank_exited(rank: int, code: int) -> None:
    os._exit(70)  # EX_SOFTWARE; the pools' names go with the resource tracker


def run_core(spec: CoreSpec, commands: Connection, events: Connection) -> None:
    """The core process's entry point (multiprocessing, spawn)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    _die_with_parent()
    _name_native_thread(f"{spec.role}-core")
    if spec.process_setup is not None:
        spec.process_setup(spec.role)  # the service's logging, before anything can log
    _widen_pipe(events)
    _set_compute_threads(spec.config.device, spec.cpu_threads)
    try:
        core = EngineCore(spec, events)
    except BaseException as e:  # noqa: BLE001 - reported to the worker, which exits
        events.send(Failed(portable(e)))
        return
    try:
        freeze_startup_heap()
        events.send(Ready(core.info()))
        core.serve(commands)
    except (BrokenPipeError, EOFError):
        pass  # the worker is gone
    finally:
        core.close()


def _widen_pipe(conn: Connection, size: int = 1 << 20) -> None:
    """Linux: a 1 MiB pipe buffer (64 KiB by default) for the events, so a burst of step
    messages while the worker's loop is busy does not stall the engine on its write."""
    import fcntl  # noqa: PLC0415

    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, size)


def _set_compute_threads(device: str, threads: int | None) -> None:
    """torch's CPU thread pool for this core: `threads` when given; else one on a GPU, where
    the host only prepares steps and a thread per core spinning between parallel regions only
    competes with the engine loop (OMP_NUM_THREADS still wins there); else torch's default."""
    import torch  # noqa: PLC0415

    if threads is not None:
        torch.set_num_threads(threads)
    elif device.startswith("cuda") and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the worker that started it dies (even by SIGKILL)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _name_native_thread(name: str) -> None:
    """The calling thread shows as `name` in top, ps and /proc (Linux; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def _host_tier_fields(tier: HostKVTier | None) -> dict[str, int]:
    """The host KV tier's counters for the snapshot (none without a tier)."""
    if tier is None:
        return {}
    s = tier.stats()
    return {"host_kv_hits": s.hits, "host_kv_misses": s.misses,
            "host_kv_evictions": s.evictions, "host_kv_bytes_used": s.bytes_used,
            "host_kv_capacity_bytes": s.capacity_bytes,
            "host_kv_bytes_allocated": s.allocated_bytes}
