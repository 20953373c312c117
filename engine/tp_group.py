"""A tensor-parallel engine: one process per rank, rank 0 the engine's own.

    rank 0 (the LLMEngine's process)               ranks 1 .. N-1 (`python -m tandem.engine.tp_group`)
    ───────────────────────────────                ─────────────────────────────────────────────
    scheduler, block pool, leases, sampler         a ModelRunner on its shard and its KV pool
    ModelRunner on shard 0, pool of its heads      loop: receive a command from rank 0, run it
    per step: broadcast StepInputs ─────────────▶  forward(inputs): same collectives, no sampling
    map / pull / describe: broadcast, run own      run own part, gather the results to rank 0
    part, gather every rank's result ◀──────────

Block ids mean the same on every rank: rank 0's block pool allocates them and every rank's
pool holds its own heads of those blocks, so one lease (one set of block ids) covers every rank.

Rank processes start with subprocess (the engine core is a daemonic multiprocessing child and
may not have multiprocessing children of its own), read their RankSpec pickled on stdin, meet
at rank 0's TCPStore on 127.0.0.1 and die with rank 0 (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tandem.engine.config import EngineConfig, ModelConfig
from tandem.engine.heap import freeze_startup_heap
from tandem.engine.host_kv_tier import HostKVTier
from tandem.engine.model_runner import ModelRunner
from tandem.engine.parallel import (
    broadcast_object,
    check_tp_size,
    gather_objects,
    init_tp,
    leave_group,
)
from tandem.errors import InvalidArgument
from tandem.kvtransfer import transports

log = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT_S = 600.0  # the slowest rank's model load is inside it
LEAVE_TIMEOUT_S = 30.0  # for the group's teardown, then for the other ranks to exit
# Transports whose pools a rank maps as tensors (kvtransfer/tp_pull.py copies heads out of them).
TP_TRANSPORTS = transports.tensor_transports()


@dataclass(frozen=True)
class RankSpec:
    config: EngineConfig
    model_dir: str
    rank: int
    store_port: int
    pool_transport: str | None = None  # share this rank's pool with peers (prefill role)
    cpu_threads: int | None = None


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: the CPU for every rank, or the r-th GPU from the one named
    (cuda:2 at TP 2: cuda:2 and cuda:3)."""
    if device == "cpu":
        return "cpu"
    base = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


class RankCommandError(RuntimeError):
    """A command failed on a rank other than 0 (its message says which and why)."""


class TPGroup:
    """Rank 0's handle on the other ranks: starts them, joins the group with them, and sends
    them every command. `close()` stops them (they also die with this process)."""

    def __init__(self, config: EngineConfig, model_dir: Path, *,
                 pool_transport: str | None = None, cpu_threads: int | None = None,
                 on_rank_exit: Callable[[int, int], None] | None = None) -> None:
        """on_rank_exit(rank, exit code): a rank ended before close() (killed, out of memory).
        Without it the engine's next collective fails instead."""
        self.size = config.tensor_parallel_size
        if pool_transport is not None and pool_transport not in TP_TRANSPORTS:
            raise InvalidArgument("transport", f"a prefill worker at tensor-parallel size "
                                  f"{self.size} shares its pools over "
                                  f"{' or '.join(TP_TRANSPORTS)}, not {pool_transport}")

        timeout = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
        # Port 0: the OS picks a free one, no race with other groups on this host.
        self._store = dist.TCPStore("127.0.0.1", 0, self.size, is_master=True,
                                    timeout=timeout, wait_for_workers=False)
        self.procs: list[subprocess.Popen] = []
        try:
            for rank in range(1, self.size):
                spec = RankSpec(config, str(model_dir), rank, self._store.port, pool_transport,
                                cpu_threads)
                proc = subprocess.Popen([sys.executable, "-m", "tandem.engine.tp_group"],
                                        stdin=subprocess.PIPE, start_new_session=False)
                proc.stdin.write(pickle.dumps(spec))
                proc.stdin.close()
                self.procs.append(proc)
            self.state = init_tp(0, self.size, self._store.port,
                                 torch.device(rank_device(config.device, 0)),
                                 RENDEZVOUS_TIMEOUT_S)
        except BaseException:
            self._kill()
            raise
        self.closed = False
        if on_rank_exit is not None:
            for rank, proc in enumerate(self.procs, start=1):
                threading.Thread(target=self._watch, args=(rank, proc, on_rank_exit),
                                 name=f"tp-rank-{rank}-watch", daemon=True).start()

    def _watch(self, rank: int, proc: subprocess.Popen,
               on_rank_exit: Callable[[int, int], None]) -> None:
        code = proc.wait()
        if not self.closed:
            log.error("tensor-parallel rank %d exited (code %d)", rank, code)
            on_rank_exit(rank, code)

    def step(self, inputs: Any) -> None:
        """Ranks 1.. run this step's forward pass (rank 0 runs its own after this returns)."""
        broadcast_object(("step", inputs), self.state)

    def call(self, name: str, args: tuple, local: Any) -> list[Any]:
        """Run command `name(*args)` on every rank, rank 0's part being `local()`; every rank's
        result in rank order. A rank's failure raises here once all have answered."""
        broadcast_object((name, args), self.state)
        try:
            mine: Any = local()
        except Exception as e:  # noqa: BLE001 - reported after the gather, in rank order
            mine = e
        results = gather_objects(mine, self.state)
        for rank, r in enumerate(results):
            if isinstance(r, BaseException):
                if rank == 0:
                    raise r
                raise RankCommandError(f"rank {rank}: {r}")
        return results

    def open_host_tier(self, tier: Any) -> None:
        """Every other rank keeps a host tier of `tier`'s capacity for its own heads and
        replays the copies `tier` flushes (engine/host_kv_tier.py)."""
        self.call("open_host_tier", (tier.index.capacity,), lambda: None)
        tier.mirror = lambda ops, wait: self.call("host_copies", (ops, wait), lambda: None)

    def close(self, before_destroy: Callable[[], None] | None = None) -> None:
        """Stop the other ranks and leave the group; `before_destroy` runs first (rank 0
        releases its CUDA graphs there, as the ranks do before they leave)."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            broadcast_object(("stop", ()), self.state)
        if before_destroy is not None:
            before_destroy()
        # Every rank leaves the group at the same time (NCCL's teardown waits for its peers),
        # and only then does rank 0 wait for the processes.
        leave_group(LEAVE_TIMEOUT_S)
        for proc in self.procs:
            try:
                proc.wait(timeout=LEAVE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        """Stop the other ranks at once (rank 0 failed while starting)."""
        self.closed = True
        self._kill()

    def _kill(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(OSError):
                proc.kill()
            proc.wait()


class RankServer:
    """Ranks 1..N-1: run the commands rank 0 broadcasts until it says stop."""

    def __init__(self, spec: RankSpec) -> None:
        config = spec.config
        self.spec = spec
        device = torch.device(rank_device(config.device, spec.rank))
        self.tp = init_tp(spec.rank, config.tensor_parallel_size, spec.store_port, device,
                          RENDEZVOUS_TIMEOUT_S)
        model_dir = Path(spec.model_dir)
        model_config = ModelConfig.from_dir(model_dir)
        sched = config.scheduler_config(model_config)
        self.kv = RankKV(spec.pool_transport, spec.rank, config.tensor_parallel_size,
                         model_config.num_kv_heads)
        self.runner = ModelRunner(
            model_config, config.cache_config(), device=str(device), dtype=config.dtype,
            model_dir=model_dir, load_format=config.load_format, seed=config.seed,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_model_len=sched.max_model_len, max_num_seqs=sched.max_num_seqs,
            cuda_graphs=config.cuda_graphs, progress=False,
            pool_factory=self.kv.pool_factory if spec.pool_transport else None,
            kv_cache_dtype_name=config.kv_cache_dtype, quantization=config.quantization,
            tp=self.tp)
        self.kv.local = self.runner.pool

    def serve(self) -> None:
        while True:
            name, args = broadcast_object(None, self.tp)
            if name == "stop":
                return
            if name == "step":
                try:
                    self.runner.forward(args)
                except Exception:  # rank 0 fails the step's requests on its own error
                    log.exception("step failed on rank %d", self.tp.rank)
                continue
            try:
                result: Any = getattr(self.kv, name)(*args)
            except Exception as e:  # noqa: BLE001 - rank 0 reports it
                result = RuntimeError(f"{type(e).__name__}: {e}")
            gather_objects(result, self.tp)

    def close(self) -> None:
        self.runner.close()  # graphs holding the communicator first, or destroying it hangs
        self.kv.close()
        leave_group(LEAVE_TIMEOUT_S)


class RankKV:
    """One rank's side of the KV handoff: its own pool (shared with peers on a prefill
    worker) and the pools of every rank of the prefill workers it mapped (decode worker);
    kvtransfer/tp_pull.py decides which heads come from which prefill rank."""

    def __init__(self, transport: str | None, rank: int = 0, size: int = 1,
                 model_kv_heads: int = 0) -> None:
        self.transport = transport
        self.rank, self.size, self.model_kv_heads = rank, size, model_kv_heads
        self.pool: Any = None  # LocalPool, when shared
        self.local: torch.Tensor | None = None
        # address -> (instance id, [RemotePool of prefill rank p for p in 0..])
        self.peers: dict[str, tuple[str, list[Any]]] = {}
        self.host_tier: Any = None  # HostKVTier replaying rank 0's copies, when it has one

    def pool_factory(self, shape, dtype, device) -> torch.Tensor:
        from tandem.kvtransfer.pool import allocate_pool  # noqa: PLC0415 - prefill ranks only

        n, layers, _, bs, heads, dim = shape
        self.pool = allocate_pool(num_blocks=n, num_layers=layers, block_size=bs,
                                  num_kv_heads=heads, head_dim=dim, dtype=dtype, device=device,
                                  transport=self.transport
                                  or transports.default_for(str(device)))
        return self.pool.tensor

    # -- commands (every rank runs its own part) -------------------------------------------
    def describe(self) -> Any:
        """This rank's pool descriptor (with its handle: a capability), or None."""
        if self.pool is None:
            return None
        return dataclasses.replace(self.pool.descriptor, model_kv_heads=self.model_kv_heads,
                                   tensor_parallel_size=self.size,
                                   tensor_parallel_rank=self.rank)

    def map(self, address: str, descriptors: list[Any], instance_id: str) -> None:
        """Map every rank's pool of the prefill worker at `address` (replacing an earlier
        instance's mapping there)."""
        from tandem.kvtransfer.remote import open_remote_pool  # noqa: PLC0415 - decode ranks only

        old = self.peers.get(address)
        if old is not None and old[0] == instance_id:
            return
        if any(d.transport not in TP_TRANSPORTS for d in descriptors):
            raise InvalidArgument("transport", "a handoff between tensor-parallel workers moves "
                                  f"heads over {' or '.join(TP_TRANSPORTS)}; a pool of "
                                  "another transport is pulled only between workers of one "
                                  "rank each")
        device = transports.map_device(descriptors[0].transport, self.local.device)
        pools = [open_remote_pool(d, device) for d in descriptors]
        self.peers[address] = (instance_id, pools)
        if old is not None:
            for pool in old[1]:
                with contextlib.suppress(Exception):
                    pool.close()

    def pull(self, address: str, instance_id: str, src_block_ids: list[int],
             dst_block_ids: list[int]) -> Any:
        """Copy this rank's heads of a request's blocks from the prefill ranks that hold them.
        Returns TransferStats."""
        from tandem.kvtransfer.tp_pull import pull_heads  # noqa: PLC0415 - decode ranks only

        instance, pools = self.peers.get(address, ("", None))
        if pools is None:
            raise RuntimeError(f"the KV pool of {address} is not mapped")
        if instance != instance_id:
            raise RuntimeError(f"the prefill worker at {address} restarted: the lease's KV "
                               "went with it")
        return pull_heads([p.tensor for p in pools], self.local, self.model_kv_heads,
                          self.rank, self.size, src_block_ids, dst_block_ids)

    def open_host_tier(self, capacity: int) -> None:
        self.host_tier = HostKVTier(self.local, capacity)
        self.host_tier.wait_for_memory()

    def host_copies(self, ops: list[tuple[bool, int, int]], wait: bool) -> None:
        """Rank 0's tier flushed these copies: the same ones on this rank's heads, issued
        before this rank's next step in the same order."""
        self.host_tier.ops = ops
        self.host_tier.flush(wait)

    def close(self) -> None:
        for _, pools in self.peers.values():
            for pool in pools:
                with contextlib.suppress(Exception):
                    pool.close()
        self.peers.clear()
        if self.pool is not None:
            with contextlib.suppress(Exception):
                self.pool.close()


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when rank 0 dies (even by SIGKILL)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def main() -> None:
    _die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides when this rank stops
        signal.signal(sig, signal.SIG_IGN)
    spec: RankSpec = pickle.loads(sys.stdin.buffer.read())
    logging.basicConfig(level=logging.WARNING,
                        format=f"rank {spec.rank}: %(levelname)s %(name)s: %(message)s")
    if spec.cpu_threads is not None:
        torch.set_num_threads(spec.cpu_threads)
    elif spec.config.device.startswith("cuda") and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    server = RankServer(spec)
    freeze_startup_heap()  # a collection's pause on one rank would stall every rank's step
    try:
        server.serve()
    finally:
        server.close()


if __name__ == "__main__":
    main()


def start_tp_group(config: EngineConfig, model_dir, model_config: ModelConfig,
                   options: dict | None) -> TPGroup:
    """Ranks 1..N-1 of a tensor-parallel engine (rank 0 is the caller's). options: TPGroup's
    keywords (pool_transport, cpu_threads)."""
    check_tp_size(model_config, config.tensor_parallel_size)
    opts = {"cpu_threads": torch.get_num_threads(), **(options or {})}
    return TPGroup(config, model_dir, **opts)
