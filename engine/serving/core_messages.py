"""What crosses the pipes between a worker (AsyncEngine) and its engine core (engine_core.py):
the spec the core is built from, one dataclass per command and per event, and a step's outputs
packed for the pipe. Plain Python, no torch: the worker process imports this, never the engine.

Commands (worker → core), each sent as Call(command, call_id); call_id 0 wants no reply:
    Add, Abort, Release, Renew, LeasesRenewed, MapPool, Lend, LendPrefix, HandOver,
    TakeSnapshot, SwitchRole, Stop
Events (core → worker):
    Ready | Failed                once, first
    Reply                         a call's result or exception
    Step                          one per engine step: its outputs (the packed tuples below),
                                  StepStats, its end time, the load snapshot after it, and
                                  the prefix-cache changes it made (KVEvents), if any
    SnapshotChanged               while idle, when the snapshot changed
    KVEvents                      while idle, prefix-cache changes made outside a step
    Aborted                       samples ended by an abort
    LeaseDone                     a lease the core held is done with (a prefill worker's,
                                  a decode worker's that lent a moving sequence, or any
                                  worker's that lent a cached prefix)
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.config import EngineConfig
from tandem.engine.sampling_params import RequestLimits, SamplingParams
from tandem.engine.sequence import RemoteKV, Replay, SeqOutput, StepStats


@dataclass(frozen=True)
class CoreSpec:
    """What the core is built from (pickled to the new process)."""

    config: EngineConfig
    role: str  # prefill, decode, both
    transport: str | None = None  # prefill: how peers map the pool (shm, cuda_ipc)
    lease_ttl_s: float = 30.0  # prefill: how long a handed-off prompt's blocks stay pinned
    lease_max_life_s: float | None = None  # prefill: renewals never pin them longer
    host: str = "127.0.0.1"  # the worker's --host (a transport that listens binds there)
    tls: Any = None  # the worker's cluster TLS, kvtransfer.transports.SiteTls (PEM bytes)
    # torch's CPU threads for the model: None is 1 on a GPU (the host only prepares steps) and
    # every core on the CPU. Engine cores that share a CPU each get their share (`tandem up`):
    # more threads than cores, spinning between parallel regions, stall every step for seconds.
    cpu_threads: int | None = None
    # Run first in the core's process with the role (a module-level function: it is pickled by
    # name): the service's logging setup, which the engine does not know.
    process_setup: Callable[[str], None] | None = None


@dataclass(frozen=True)
class CoreInfo:
    """Sent once the core is ready. `layout`: its KV pool's, by the fields a PoolDescriptor
    names (kvtransfer.descriptor.LAYOUT_FIELDS and num_blocks); `pool`: a prefill core's
    descriptor (with its handle: never logged)."""

    layout: dict[str, Any]
    pid: int
    pool: Any = None  # kvtransfer.descriptor.PoolDescriptor
    limits: RequestLimits | None = None
    # A tensor-parallel prefill core: the pools of its ranks 1 .. N-1 (`pool` is rank 0's).
    rank_pools: tuple = ()
    # A host KV tier shared by the workers of a host (engine/shared_host_tier.py): its id.
    host_tier_id: str = ""


@dataclass(frozen=True)
class EngineSnapshot:
    """Load and counters, read on the core between steps."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_leases: int = 0
    num_requests: int = 0  # requests in the engine
    num_requests_added: int = 0
    block_size: int = 0
    prefix_queries: int = 0  # blocks looked up in the prefix cache
    prefix_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens_computed: int = 0  # prompt tokens run through the model
    kv_blocks_pulled: int = 0  # decode role: blocks copied in from prefill workers
    kv_bytes_pulled: int = 0
    kv_runs_pulled: int = 0  # the copies those blocks took (kvtransfer/runs.py)
    kv_pull_seconds: float = 0.0  # the time those pulls took (LeaseDone.seconds, summed)
    # Speculative decoding (engine/spec_decode/): draft tokens scored and accepted, and per
    # draft position j, drafts at j scored and accepted.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_drafted_at: tuple[int, ...] = ()
    spec_accepted_at: tuple[int, ...] = ()
    # Back-off by acceptance (engine/spec_decode/backoff.py): times a sample stopped
    # speculating, and (sample, step) pairs it sat out.
    spec_backoffs: int = 0
    spec_backoff_steps: int = 0
    # A draft model's own KV pool (engine/spec_decode/draft.py), in blocks; 0 without one.
    spec_draft_blocks_used: int = 0
    spec_draft_blocks: int = 0
    # Host KV tier (engine/host_kv_tier.py), in blocks; all 0 when the engine has none.
    host_kv_hits: int = 0
    host_kv_misses: int = 0
    host_kv_evictions: int = 0
    host_kv_bytes_used: int = 0
    host_kv_capacity_bytes: int = 0
    host_kv_bytes_allocated: int = 0  # host memory the tier has taken (<= its capacity)
    # Live migration (engine/migration.py): blocks pulled from other decode workers (of
    # kv_blocks_pulled), requests moved in that way, and leases lent on running requests.
    kv_blocks_migrated: int = 0
    migrations_in: int = 0
    migrations_lent: int = 0

    @property
    def idle(self) -> bool:
        """No request, no lease, every block free (cached blocks count as free)."""
        return (not self.num_requests and not self.num_leases
                and self.num_free_blocks == self.num_blocks)


@dataclass(frozen=True)
class LeaseDone:
    """Decode role: the core is done with a prefill worker's lease (its KV pulled, the pull
    failed, or the request ended first): the worker releases it. Sent exactly once for every
    request whose add reached the core. `seconds` and the rest describe the pull, if one ran."""

    request_id: str
    address: str
    lease_id: str
    pulled: bool = False
    start_ns: int = 0  # time.time_ns()
    end_ns: int = 0
    num_blocks: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    transport: str = ""
    error: str | None = None  # why the pull failed
    num_runs: int = 0  # copies of blocks adjacent in both pools (0: a pull of heads, per rank)


# -- commands (worker -> core) --------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Add:
    """Start a request; `remote`: where its prompt KV is (decode role), else it prefills here;
    `replay`: prefilled here, with the tokens its client has (a request moved with no prefill
    worker up)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    remote: RemoteKV | None = None
    replay: Replay | None = None


@dataclass(frozen=True, slots=True)
class Abort:
    """Drop a request (replies whether the core held it)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Release:
    """Prefill role: unpin a lease's blocks (replies whether it was live)."""

    lease_id: str


@dataclass(frozen=True, slots=True)
class Renew:
    """Prefill role: give these leases a full time to live from now (replies the seconds each
    has left, 0.0 for one that is not live)."""

    lease_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LeasesRenewed:
    """Decode role: the prefill workers renewed these leases; (token, new deadline on this
    host's monotonic clock) each. A lease the core no longer holds is skipped."""

    deadlines: tuple[tuple[str, float], ...]


@dataclass(frozen=True, slots=True)
class MapPool:
    """Map the pool of the worker process `instance_id` at `address` (a decode worker's
    prefill workers, and any worker's lenders of a cached prefix)."""

    address: str
    descriptor: Any  # kvtransfer.descriptor.PoolDescriptor
    instance_id: str = ""


@dataclass(frozen=True, slots=True)
class Lend:
    """Decode role, live migration's source: a lease on a running request's KV (replies a
    sequence.Lent, or None: it has none to lend and moves by token replay)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class LendPrefix:
    """Prefill and decode roles: a lease on the longest prefix of these tokens (whole blocks,
    keyed under `cache_salt`) that the pool caches or its host tier holds, for a worker of
    another host to pull (replies a sequence.Lent, or None: none held)."""

    token_ids: tuple[int, ...]
    cache_salt: str = ""


@dataclass(frozen=True, slots=True)
class HandOver:
    """Decode role, live migration's destination: the source stopped the request; per sample,
    the tokens it made since the request came here. Recorded, and the request decodes on."""

    request_id: str
    tokens: tuple[tuple[int, ...], ...]
    received: float = 0.0  # when the worker got it (time.monotonic()): the switch is timed


@dataclass(frozen=True, slots=True)
class TakeSnapshot:
    """Reply with an EngineSnapshot taken between two steps."""


@dataclass(frozen=True, slots=True)
class SwitchRole:
    """Serve `role` from now on (prefill or decode, from the other), keeping the model and
    the KV pool; only while idle (replies None, or raises why not). The lease settings and
    the cluster TLS (SiteTls, for transports that dial peers) are the new role's."""

    role: str
    lease_ttl_s: float = 30.0
    lease_max_life_s: float | None = None
    tls: Any = None


@dataclass(frozen=True, slots=True)
class Stop:
    """Leave the loop; the process exits."""


Command = (Add | Abort | Release | Renew | LeasesRenewed | MapPool | Lend | LendPrefix
           | HandOver | TakeSnapshot | SwitchRole | Stop)


@dataclass(frozen=True, slots=True)
class Call:
    command: Command
    call_id: int = 0  # 0: no reply


# -- events (core -> worker) -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Ready:
    info: CoreInfo


@dataclass(frozen=True, slots=True)
class Failed:
    error: BaseException  # the core could not start (portable())


@dataclass(frozen=True, slots=True)
class Reply:
    call_id: int
    result: Any = None
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class Step:
    plain: list[PlainOutput]  # pack_outputs
    whole: list[SeqOutput]
    stats: StepStats | None  # None: the step failed as a whole
    end: float  # time.perf_counter() on the core when the step ended
    snapshot: EngineSnapshot
    kv_events: KVEvents | None = None


@dataclass(frozen=True, slots=True)
class KVEvents:
    """Block hashes the prefix cache stored and evicted (BlockPool.take_events), in the order
    the worker must apply them: a hash appears in one list at most. The host tier's
    (engine/host_kv_tier.py), where there is one: the hashes it now holds and those it dropped,
    a set of its own (a block evicted from the pool into the tier is in `removed` and in
    `host_stored`; one restored to the pool is in `stored` and stays in the tier)."""

    stored: list[int]
    removed: list[int]
    host_stored: list[int] = field(default_factory=list)
    host_removed: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class SnapshotChanged:
    snapshot: EngineSnapshot


@dataclass(frozen=True, slots=True)
class Aborted:
    num_samples: int


Event = Ready | Failed | Reply | Step | SnapshotChanged | KVEvents | Aborted | LeaseDone


# One output of a step as the pipe carries it when it is only new tokens: (request_id,
# sample_index, new_token_ids, num_prompt_tokens, num_cached_tokens, num_output_tokens).
PlainOutput = tuple[str, int, list[int], int, int, int]


def pack_outputs(outputs: list[SeqOutput]) -> tuple[list[PlainOutput], list[SeqOutput]]:
    """A step's outputs for the pipe: those that only bring tokens as tuples (pickled at a
    quarter of a dataclass's cost: 256 of them, 120 µs against 400 µs on the development VM),
    ends, handoffs, errors and logprobs whole. `unpack_outputs` undoes it."""
    plain: list[PlainOutput] = []
    whole: list[SeqOutput] = []
    for o in outputs:
        if (o.finish_reason is None and o.error is None and o.timing is None
                and o.prompt_logprobs is None
                and (not o.new_logprobs or o.new_logprobs[0] is None)):
            plain.append((o.request_id, o.sample_index, o.new_token_ids, o.num_prompt_tokens,
                          o.num_cached_tokens, o.num_output_tokens))
        else:
            whole.append(o)
    return plain, whole


def unpack_outputs(plain: list[PlainOutput], whole: list[SeqOutput]) -> list[SeqOutput]:
    return [*(SeqOutput(rid, i, toks, [None] * len(toks), None, n_prompt, n_cached, n_out)
              for rid, i, toks, n_prompt, n_cached, n_out in plain), *whole]


def portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling, else a RuntimeError with its type and text."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc
