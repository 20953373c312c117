"""The CUDA IPC rows of benchmarks/transfer/kv_transfer.py: this process (the decode worker) opens the
producer's pool over CUDA IPC and moves the prompt's scattered blocks into its own pool with
pull_blocks and every alternative (the copy_blocks kernel alone, torch gathers, cudaMemcpyAsync
per block or per layer chunk, one cuMemcpyBatchAsync), each timed and checked byte for byte
against one large peer copy of the same bytes, the bound. pull_blocks also moves the prompt as
one run of adjacent blocks and as 8 runs (the copy engines, one cudaMemcpyAsync per run), and
the kernel and the copy engines are timed on 2 to 32 runs: where one stops winning is
kvtransfer.remote.MAX_COPY_RUNS."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.transfer.kv_transfer_blocks import as_bytes, blocks_match, run_ids, summary, time_op
from tandem.kvtransfer.descriptor import PoolDescriptor
from tandem.kvtransfer.pool import TORCH_DTYPES, allocate_pool
from tandem.kvtransfer.remote import MAX_COPY_RUNS, launch_pull, open_remote_pool, pull_blocks

PULL = "pull_blocks, scattered blocks (copy_blocks kernel)"
PULL_ADJACENT = "pull_blocks, adjacent blocks (1 run, copy engines)"
RUN_COUNTS = (2, 4, 8, 16, 32)

CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from the (UVA) pointers


def measure_ipc(args: argparse.Namespace, desc: PoolDescriptor, src_dev: int, dst_dev: int,
        shape: dict[str, int], src_ids: list[int], dst_ids: list[int],
        dtype: str) -> dict[str, Any]:
    """The decode worker: open the producer's pool, time and check every method."""
    import cupy

    from benchmarks.transfer import cuda_batch
    from tandem.kernels.copy_blocks import copy_blocks

    runtime = cupy.cuda.runtime
    dev = torch.device("cuda", dst_dev)
    torch.cuda.set_device(dev)
    remote = open_remote_pool(desc, dev)
    local = allocate_pool(device=dev, transport="cuda_ipc", dtype=TORCH_DTYPES[dtype], **shape)
    src_pool, dst_pool = remote.tensor, local.tensor
    bb = desc.block_bytes
    n = len(src_ids)
    nbytes = n * bb
    src_t = torch.tensor(src_ids, device=dev)
    dst_t = torch.tensor(dst_ids, device=dev)
    stream = torch.cuda.current_stream(dev).cuda_stream
    chunk = bb // (args.num_layers * 2)  # one layer's K or V of one block

    def memcpy(dst: int, src: int, size: int) -> None:
        runtime.memcpyAsync(dst, src, size, CUDA_MEMCPY_DEFAULT, stream)

    def per_block() -> None:
        s0, d0 = src_pool.data_ptr(), dst_pool.data_ptr()
        for s, d in zip(src_ids, dst_ids, strict=True):
            memcpy(d0 + d * bb, s0 + s * bb, bb)

    def per_chunk() -> None:
        s0, d0 = src_pool.data_ptr(), dst_pool.data_ptr()
        for s, d in zip(src_ids, dst_ids, strict=True):
            for c in range(0, bb, chunk):
                memcpy(d0 + d * bb + c, s0 + s * bb + c, chunk)

    contiguous_src = list(range(n))  # blocks 0..n-1 of the producer, one contiguous range
    contiguous_dst = list(range(n))
    adjacent_t = torch.arange(n, device=dev)
    runs8 = run_ids(n, 8, shape["num_blocks"], args.seed)

    side = torch.cuda.Stream(dev)  # the batch API refuses the legacy default stream

    def batched(flags: int) -> None:
        current = torch.cuda.current_stream(dev)
        side.wait_stream(current)
        cuda_batch.batch_copy(dst_pool.data_ptr(), src_pool.data_ptr(), dst_ids, src_ids, bb,
                              side.cuda_stream, dst_dev, flags)
        current.wait_stream(side)

    def contiguous() -> None:
        memcpy(dst_pool.data_ptr(), src_pool.data_ptr(), nbytes)

    pull_seconds: dict[str, list[float]] = {}

    def pull(name: str, s_ids: list[int], d_ids: list[int]) -> Callable[[], None]:
        seconds = pull_seconds.setdefault(name, [])
        return lambda: seconds.append(pull_blocks(remote, dst_pool, s_ids, d_ids).seconds)

    pulls = {PULL: (src_ids, dst_ids), PULL_ADJACENT: (contiguous_src, contiguous_dst),
             f"pull_blocks, 8 runs of {n // 8} blocks (copy engines)": runs8}
    methods: dict[str, tuple[Callable[[], object], list[int], list[int]]] = {
        name: (pull(name, s, d), s, d) for name, (s, d) in pulls.items()}
    methods.update({
        "copy_blocks kernel alone (ids already on the device)": (
            lambda: copy_blocks(src_pool, dst_pool, src_t, dst_t), src_ids, dst_ids),
        "torch index_select + index_copy_": (  # as bytes: no float8 index_copy_ in torch
            lambda: as_bytes(dst_pool).index_copy_(0, dst_t,
                                                   as_bytes(src_pool).index_select(0, src_t)),
            src_ids, dst_ids),
        f"cudaMemcpyAsync per {bb / 2**20:g} MiB block": (per_block, src_ids, dst_ids),
        f"cudaMemcpyAsync per {chunk // 1024} KiB layer chunk": (per_chunk, src_ids, dst_ids),
        "one cudaMemcpyAsync, contiguous, over IPC": (contiguous, contiguous_src, contiguous_dst),
        # the same kernel on adjacent blocks: what scattering the blocks costs the copy itself
        "copy_blocks kernel alone, adjacent blocks": (
            lambda: copy_blocks(src_pool, dst_pool, adjacent_t, adjacent_t),
            contiguous_src, contiguous_dst),
    })
    for k in RUN_COUNTS:  # the copy engines against the kernel by number of runs
        s_ids, d_ids = run_ids(n, k, shape["num_blocks"], args.seed)
        s_t, d_t = torch.tensor(s_ids, device=dev), torch.tensor(d_ids, device=dev)
        methods[f"{k} runs: copy_blocks kernel alone"] = (
            lambda s_t=s_t, d_t=d_t: copy_blocks(src_pool, dst_pool, s_t, d_t), s_ids, d_ids)
        methods[f"{k} runs: cudaMemcpyAsync per run"] = (
            lambda s=s_ids[::n // k], d=d_ids[::n // k], k=k: [
                memcpy(dst_pool.data_ptr() + dd * bb, src_pool.data_ptr() + ss * bb,
                       n // k * bb) for ss, dd in zip(s, d, strict=True)], s_ids, d_ids)
    if cuda_batch.available():
        methods["cuMemcpyBatchAsync, one call (copy engines)"] = (
            lambda: batched(0), src_ids, dst_ids)
        methods["cuMemcpyBatchAsync, prefer overlap with compute"] = (
            lambda: batched(cuda_batch.FLAG_PREFER_OVERLAP_WITH_COMPUTE), src_ids, dst_ids)
    out: dict[str, dict[str, Any]] = {}
    with cupy.cuda.Device(dst_dev):
        out["one large peer copy (bound)"] = large_copy(nbytes, src_dev, dev, args)
        for name, (op, s_ids, d_ids) in methods.items():
            as_bytes(dst_pool).zero_()
            op()
            torch.cuda.synchronize(dev)
            correct = blocks_match(dst_pool, d_ids, s_ids)
            times = time_op(op, dev, args.warmup, args.repeats)
            out[name] = summary(times, nbytes, correct)
        if args.sweep:
            out.update(sweep_copy_configs(src_pool, dst_pool, src_t, dst_t, dev, args, nbytes))
    bound = out["one large peer copy (bound)"]["gbps"]
    for m in out.values():
        m["vs_large_copy"] = m["gbps"] / bound
    for name, (s_ids, d_ids) in pulls.items():
        out[name]["wall_clock_median_ms"] = (
            statistics.median(pull_seconds[name][-args.repeats:]) * 1e3)  # the timed calls
        out[name]["launch_host_median_us"] = launch_host_us(
            remote, dst_pool, s_ids, d_ids, args.repeats)
        out[name]["in_stream_device_median_ms"] = in_stream_ms(
            remote, dst_pool, s_ids, d_ids, args.repeats)
    remote.close()
    local.close()
    return {
        "src_card": torch.cuda.get_device_name(src_dev),
        "dst_card": torch.cuda.get_device_name(dst_dev),
        "src_device": src_dev, "dst_device": dst_dev,
        "gpus": torch.cuda.device_count(),
        "peer_access": (torch.cuda.can_device_access_peer(dst_dev, src_dev)
                        if dst_dev != src_dev else None),
        "producer": "separate process, pool opened over CUDA IPC",
        "config": {**shape, "dtype": dtype, "prompt_tokens": args.prompt_tokens,
                   "max_copy_runs": MAX_COPY_RUNS,
                   "blocks_moved": n, "block_bytes": bb, "bytes_moved": nbytes,
                   "warmup": args.warmup, "repeats": args.repeats, "seed": args.seed},
        "torch": torch.__version__, "cupy": cupy.__version__,
        "methods": out,
    }


def in_stream_ms(remote, local: torch.Tensor, src_ids: list[int], dst_ids: list[int],
                 repeats: int) -> float:
    """Median device time of launch_pull's copies launched behind a busy stream, as a decode
    worker launches them behind its step in flight: the events around the copies then time
    the copies alone, not the host's launch (which an idle stream would wait for)."""
    times = []
    for _ in range(repeats + 3):
        torch.cuda._sleep(2_000_000)  # ~1 ms of a spinning kernel, longer than any launch
        pending = launch_pull(remote, local, src_ids, dst_ids)
        pending.wait()
        times.append(pending.stats().seconds)
    return statistics.median(times[3:]) * 1e3


def launch_host_us(remote, local: torch.Tensor, src_ids: list[int], dst_ids: list[int],
                   repeats: int) -> float:
    """Median host time of launch_pull (checks, ids upload, the kernel's launch) until it
    returns, each pull waited for before the next: what a decode worker's engine thread spends
    per pull while the copy itself runs in the stream."""
    times = []
    for _ in range(repeats + 3):
        start = time.perf_counter()
        pending = launch_pull(remote, local, src_ids, dst_ids)
        times.append(time.perf_counter() - start)
        pending.wait()
    return statistics.median(times[3:]) * 1e6


def sweep_copy_configs(src_pool, dst_pool, src_t, dst_t, dev, args, nbytes
                       ) -> dict[str, dict[str, Any]]:
    """Time the copy_blocks kernel alone (no id upload, no sync) under tile configurations."""
    from tandem.kernels.copy_blocks import CopyConfig, copy_blocks

    out = {}
    for block in (512, 1024, 2048, 4096):
        for tiles in (1, 4, 8):
            for warps in (4, 8, 16):
                for cache in ("", ".cg"):
                    cfg = CopyConfig(block, tiles, warps, cache)
                    op = lambda cfg=cfg: copy_blocks(src_pool, dst_pool, src_t, dst_t,  # noqa: E731
                                                     config=cfg)
                    times = time_op(op, dev, args.warmup, args.repeats)
                    out[f"copy_blocks {cfg}"] = summary(times, nbytes, True)
    return out


def large_copy(nbytes: int, src_dev: int, dev: torch.device,
               args: argparse.Namespace) -> dict[str, Any]:
    """The bound: one copy of `nbytes` contiguous bytes GPU src -> GPU dst in this process."""
    big_src = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src_dev}").random_(0, 256)
    big_dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    times = time_op(lambda: big_dst.copy_(big_src), dev, args.warmup, args.repeats)
    return summary(times, nbytes, torch.equal(big_dst.cpu(), big_src.cpu()))
