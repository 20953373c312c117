"""What crosses the pipes between a worker (AsyncEngine) and its engine core (engine_core.py):
the spec the core is built from, what it reports back (its layout, load snapshots, lease
events), and a step's outputs packed for the pipe. Plain Python, no torch: the worker process
imports this, never the engine.

Commands (worker → core), each (name, call id, *args); call id 0 wants no reply:
    add(request_id, prompt, params, RemoteSource | None), abort(request_id),
    release(lease_id), map(address, PoolDescriptor, instance id), snapshot(), stop()
Events (core → worker):
    ready(CoreInfo) | failed(exception)        once, first
    reply(call id, result, exception)
    step(plain outputs, whole outputs, StepStats | None, perf_counter at its end, snapshot)
    snapshot(EngineSnapshot)                   when it changed while idle
    aborted(samples)                           samples ended by an abort
    lease_done(LeaseDone)                      decode role
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.sampling_params import TokenLogprobs
from engine.sequence import SeqOutput


@dataclass(frozen=True)
class CoreSpec:
    """What the core is built from (pickled to the new process)."""

    config: EngineConfig
    role: str  # prefill, decode, both
    transport: str | None = None  # prefill: how peers map the pool (shm, cuda_ipc)
    lease_ttl_s: float = 30.0  # prefill: how long a handed-off prompt's blocks stay pinned
    # torch's CPU threads for the model: None is 1 on a GPU (the host only prepares steps) and
    # every core on the CPU. Engine cores that share a CPU each get their share (`tandem up`):
    # more threads than cores, spinning between parallel regions, stall every step for seconds.
    cpu_threads: int | None = None
    # Run first in the core's process with the role (a module-level function: it is pickled by
    # name): the service's logging setup, which the engine does not know.
    process_setup: Callable[[str], None] | None = None


@dataclass(frozen=True)
class RequestLimits:
    """What a request's ids and lengths must respect, for a worker to check them before the
    engine sees them."""

    vocab_size: int  # token ids are in [0, vocab_size)
    max_model_len: int  # tokens in all, prompt included
    max_n: int  # samples per request


@dataclass(frozen=True)
class CoreInfo:
    """Sent once the core is ready. `layout`: its KV pool's, by the fields a PoolDescriptor
    names (kvtransfer.descriptor.LAYOUT_FIELDS and num_blocks); `pool`: a prefill core's
    descriptor (with its handle: never logged)."""

    layout: dict[str, Any]
    pid: int
    pool: Any = None  # kvtransfer.descriptor.PoolDescriptor
    limits: RequestLimits | None = None


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

    @property
    def idle(self) -> bool:
        """No request, no lease, every block free (cached blocks count as free)."""
        return (not self.num_requests and not self.num_leases
                and self.num_free_blocks == self.num_blocks)


@dataclass(frozen=True)
class RemoteSource:
    """Decode role: where a request's prompt KV is, as the prefill worker answered its claim
    (never as the worker's caller said)."""

    address: str  # the prefill worker (its pool must be mapped: "map")
    lease_id: str  # the lease's token: a capability, never logged
    deadline: float  # time.monotonic() (one clock host-wide) after which blocks may be reused
    block_ids: tuple[int, ...]  # from the claim
    first_token_ids: tuple[int, ...]
    first_logprobs: tuple[TokenLogprobs | None, ...]
    # Per sample, outputs after the first that the client already has (a request moved here
    # mid-stream; RemoteKV.resume_token_ids), else empty.
    resume_token_ids: tuple[tuple[int, ...], ...] = ()
    # The prefill worker process that granted the lease: its pool is the one "map" mapped
    # for that instance; a request from an earlier instance (restarted since) cannot be pulled.
    instance_id: str = ""


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
