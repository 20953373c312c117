"""The NIXL rows of benchmarks/transfer/kv_transfer.py (--nixl): a producer process serves the pattern from
a pool registered with NIXL, and this process reads the same blocks into a registered pool of
its own with NIXL READs, as a decode worker with `--transport nixl` does, then writes them back:
the prompt's blocks scattered (one descriptor each), adjacent but paired in opposite directions
(still one descriptor each), in 8 runs, and in one run (one descriptor)."""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from benchmarks.transfer.kv_transfer_blocks import (
    as_bytes,
    blocks_match,
    fill_pattern,
    run_ids,
    summary,
)
from tandem.kvtransfer.descriptor import PoolDescriptor
from tandem.kvtransfer.pool import TORCH_DTYPES, allocate_pool


def nixl_producer(conn: Connection, device: str, shape: dict[str, int], dtype: str) -> None:
    """A prefill worker with `--transport nixl`: a pattern-filled pool registered with its NIXL
    agent, served until told to stop."""
    pool = allocate_pool(device=device, transport="nixl", dtype=TORCH_DTYPES[dtype], **shape)
    fill_pattern(pool.tensor)
    _sync(pool.tensor.device)
    conn.send(pool.descriptor)
    with contextlib.suppress(EOFError):
        conn.recv()
    pool.close()
    with contextlib.suppress(OSError):
        conn.send(True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(op, args: argparse.Namespace) -> list[float]:
    """Wall seconds of each of args.repeats calls of `op`, after args.warmup untimed ones."""
    times = []
    for i in range(args.warmup + args.repeats):
        t0 = time.perf_counter()
        op()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return times


def measure_nixl(args: argparse.Namespace, src: str, dst: str, shape: dict[str, int],
                 dtype: str, src_ids: list[int], dst_ids: list[int]) -> dict[str, dict[str, Any]]:
    """NIXL READs of the same blocks from a producer process's registered pool on device `src`
    into a pool on `dst`, then WRITEs of them back (wall clock: post to completion, as
    NixlRemotePool.pull and .push wait); with this side's agent running NIXL's progress thread,
    without it (then only the wait's polls progress UCX here: what a decode worker runs), and
    with UCX's thread pool posting a transfer's descriptors from 4 threads, 32 at a time."""
    from tandem.kvtransfer.nixl import NixlEndpoint, load_nixl

    def posting_threads() -> NixlEndpoint:
        api = load_nixl()
        name = f"tandem-bench-{os.getpid()}-posting"
        agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False,
                                                           backends=[]))
        agent.create_backend("UCX", {"num_threads": "4", "split_batch_size": "32"})
        return NixlEndpoint(name, agent, progress_thread=False)

    variants = {"progress thread": lambda: NixlEndpoint(progress_thread=True),
                "no progress thread": lambda: NixlEndpoint(progress_thread=False),
                "4 posting threads": posting_threads}

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=nixl_producer, args=(child_conn, src, shape, dtype))
    proc.start()
    child_conn.close()
    out: dict[str, dict[str, Any]] = {}
    try:
        desc: PoolDescriptor = conn.recv()
        local = torch.zeros(desc.shape, dtype=TORCH_DTYPES[dtype], device=torch.device(dst))
        for label, make in variants.items():
            endpoint = make()
            try:
                rows = _rows(args, endpoint, desc, local, shape, src_ids, dst_ids)
            finally:
                endpoint.close()
            out.update({f"{name} [{label}]": row for name, row in rows.items()})
        conn.send("stop")
        conn.recv()
    finally:
        conn.close()
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    return out


def _rows(args: argparse.Namespace, endpoint, desc: PoolDescriptor, local: torch.Tensor,
          shape: dict[str, int], src_ids: list[int], dst_ids: list[int]
          ) -> dict[str, dict[str, Any]]:
    """Every READ and WRITE row through one endpoint, each checked byte for byte."""
    dev = local.device
    n = len(src_ids)
    nbytes = n * desc.block_bytes
    remote = endpoint.connect(desc)
    out = {}
    adjacent = list(range(n))
    runs8 = run_ids(n, 8, shape["num_blocks"], args.seed)
    cases = {"nixl READ, scattered blocks (NixlRemotePool.pull)": (src_ids, dst_ids),
             "nixl READ, adjacent blocks, one descriptor each": (adjacent, adjacent[::-1]),
             f"nixl READ, 8 runs of {n // 8} blocks": runs8,
             "nixl READ, adjacent blocks (1 run: one descriptor)": (adjacent, adjacent)}
    for name, (s_ids, d_ids) in cases.items():
        as_bytes(local).zero_()
        _sync(dev)
        remote.pull(local, s_ids, d_ids)  # registers the local pool on first use
        correct = blocks_match(local, d_ids, s_ids)
        times = _timed(lambda s=s_ids, d=d_ids: remote.pull(local, s, d), args)
        out[name] = summary(times, nbytes, correct)
    # Pushes (one NIXL WRITE into the peer's pool; last, as they change it): the same
    # blocks the other way, made unlike the peer's first, then read back to check, then put
    # back as they were (the next endpoint's READs check the peer's pattern).
    as_bytes(local).bitwise_not_()
    check = torch.zeros_like(local)
    pushes = {"nixl WRITE, scattered blocks (NixlRemotePool.push)": (src_ids, dst_ids),
              f"nixl WRITE, 8 runs of {n // 8} blocks": runs8,
              "nixl WRITE, adjacent blocks (1 run: one descriptor)": (adjacent, adjacent)}
    for name, (s_ids, d_ids) in pushes.items():
        _sync(dev)
        remote.push(local, d_ids, s_ids)
        as_bytes(check).zero_()
        _sync(dev)  # NIXL's copies are not ordered after this stream's work
        remote.pull(check, s_ids, d_ids)
        got, want = as_bytes(check), as_bytes(local)  # bytes: the flipped ones hold NaNs
        correct = all(torch.equal(got[d], want[d]) for d in d_ids)
        times = _timed(lambda s=s_ids, d=d_ids: remote.push(local, d, s), args)
        out[name] = summary(times, nbytes, correct)
    fill_pattern(local)  # block b: the peer's pattern of block b, written back where it was
    _sync(dev)
    written = sorted({b for s_ids, _ in pushes.values() for b in s_ids})
    remote.push(local, written, written)
    remote.close()
    return out
