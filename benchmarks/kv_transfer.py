"""Move the KV of one 2k-token prompt from a prefill worker's GPU to a decode worker's GPU, the
way Tandem does, against the ways it could, and against the link's bound.

Llama-3.1-8B-shaped pool: 32 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks, so one
block is 2 MiB and a 2048-token prompt is 128 blocks, 268 MB.

A producer process (the prefill worker) allocates a cuda_ipc pool on GPU 0 and fills it with a
pattern. This process (the decode worker) opens it over CUDA IPC on GPU 1, as in deployment,
and moves 128 blocks chosen by scattered ids into scattered blocks of its own pool with:

    pull_blocks              kvtransfer: one kernels.copy_blocks launch, then a stream sync
    torch index_select+copy  gather into a temporary on GPU 1, then index_copy_
    memcpy per block         one cudaMemcpyAsync per 2 MiB block (128 calls)
    memcpy per layer chunk   one per block, layer and K/V, 32 KiB each (8192 calls): what a
                             layer-major pool would need
    contiguous IPC memcpy    one cudaMemcpyAsync of 128 adjacent blocks over the IPC mapping

and, as the bound, one large peer copy: torch copy_ of a contiguous 268 MB tensor GPU 0 ->
GPU 1, measured in the same run. With --kv-cache-dtype auto fp8 the whole measurement runs for
the model dtype's pool and for an FP8 (e4m3, 1 byte an element) pool, and a last table compares
the two: an FP8 block is half the bytes, so the pull should take about half the time. Every method's result is checked byte for byte. With one GPU,
everything runs on GPU 0 and the bound is a device-to-device copy.

Times are CUDA-event medians on the decode side's stream. pull_blocks' own wall-clock seconds
(id upload, launch, sync) are reported too.

With --nixl (needs the nixl extra) a second producer process serves the same pattern from a
pool registered with NIXL (transport "nixl", VRAM on the source GPU), and this process reads the
same scattered blocks into a registered VRAM pool of its own with one NIXL READ (UCX picks the
path: cuda_ipc over NVLink between GPUs of one host, unless UCX_TLS says otherwise), as a decode
worker does with `--transport nixl`. Its rows are wall-clock medians from posting the READ to
seeing it complete: the same thing pull_blocks' wall clock measures.

    python benchmarks/kv_transfer.py --out kv_transfer.json
    python benchmarks/kv_transfer.py --nixl --out kv_transfer_nixl.json
    python benchmarks/kv_transfer.py --kv-cache-dtype auto fp8 --ttft-model \
        benchmarks/configs/llama-3.1-8b --out kv_transfer_fp8.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks.kv_transfer_blocks import as_bytes, blocks_match, fill_pattern, summary, time_op
from benchmarks.kv_transfer_nixl import measure_nixl
from kvtransfer.descriptor import PoolDescriptor
from kvtransfer.pool import TORCH_DTYPES, allocate_pool
from kvtransfer.remote import launch_pull, open_remote_pool, pull_blocks

CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from the (UVA) pointers


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--prompt-tokens", type=int, default=2048, help="tokens whose KV moves")
    p.add_argument("--num-layers", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16",
                   help="the model dtype (the pool's with --kv-cache-dtype auto)")
    p.add_argument("--kv-cache-dtype", nargs="+", choices=["auto", "fp8"], default=["auto"],
                   help="pool dtype(s) to measure, one run each: auto = --dtype, fp8 = e4m3")
    p.add_argument("--pool-blocks", type=int, default=1024,
                   help="blocks in each pool (producer and consumer); ids are drawn from these")
    p.add_argument("--src-device", type=int, default=0, help="the producer's GPU")
    p.add_argument("--dst-device", type=int, default=None,
                   help="the consumer's GPU (default: 1 if there are two GPUs, else 0)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-model", default=None,
                   help="also time the prefill of the prompt with this model config (dummy "
                        "weights) on the source GPU, e.g. benchmarks/configs/llama-3.1-8b")
    p.add_argument("--sweep", action="store_true",
                   help="also time the copy_blocks kernel alone under many tile configurations")
    p.add_argument("--nixl", action="store_true",
                   help="also move the blocks over NIXL (transport nixl), pool to pool")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    return p.parse_args()


def pool_dtype(args: argparse.Namespace, kv_cache_dtype: str) -> str:
    return "float8_e4m3fn" if kv_cache_dtype == "fp8" else args.dtype


def producer(conn: Connection, device: int, shape: dict[str, int], dtype: str) -> None:
    """The prefill worker: owns a pattern-filled pool until told to stop (or the pipe closes),
    then reports whether its memory is freed."""
    pool = allocate_pool(device=f"cuda:{device}", transport="cuda_ipc",
                         dtype=TORCH_DTYPES[dtype], **shape)
    fill_pattern(pool.tensor)
    torch.cuda.synchronize(device)
    conn.send(pool.descriptor)
    with contextlib.suppress(EOFError):
        conn.recv()
    pool.close()
    with contextlib.suppress(OSError):
        conn.send(not pool.mapped)


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    runs = [measure(args, kv) for kv in args.kv_cache_dtype]
    if len(runs) > 1:
        compare(runs)
    if args.out:
        out = runs[0] if len(runs) == 1 else {"runs": runs}
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    if not all(m["correct"] for r in runs for m in r["methods"].values()):
        sys.exit("some method moved the wrong bytes (see 'correct')")


def measure(args: argparse.Namespace, kv_cache_dtype: str) -> dict[str, Any]:
    """The whole measurement for one pool dtype: a producer process, every method, report."""
    dtype = pool_dtype(args, kv_cache_dtype)
    src_dev = args.src_device
    dst_dev = args.dst_device
    if dst_dev is None:
        dst_dev = 1 if torch.cuda.device_count() > 1 else 0
    shape = dict(num_blocks=args.pool_blocks, num_layers=args.num_layers,
                 block_size=args.block_size, num_kv_heads=args.num_kv_heads,
                 head_dim=args.head_dim)
    n = math.ceil(args.prompt_tokens / args.block_size)
    rng = random.Random(args.seed)
    src_ids = rng.sample(range(args.pool_blocks), n)  # distinct, scattered, unordered
    dst_ids = rng.sample(range(args.pool_blocks), n)

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=producer, args=(child_conn, src_dev, shape, dtype))
    proc.start()
    child_conn.close()  # so that a dead producer reads as EOF here
    try:
        desc: PoolDescriptor = conn.recv()
        results = run(args, desc, src_dev, dst_dev, shape, src_ids, dst_ids, dtype)
        conn.send("stop")
        results["producer_freed_its_pool"] = conn.recv()
    finally:
        conn.close()
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    if args.nixl:
        results["methods"].update(measure_nixl(args, f"cuda:{src_dev}", f"cuda:{dst_dev}", shape,
                                               dtype, src_ids, dst_ids))
        bound = results["methods"]["one large peer copy (bound)"]["gbps"]
        for m in results["methods"].values():
            m["vs_large_copy"] = m["gbps"] / bound
        results["ucx_tls"] = os.environ.get("UCX_TLS", "(UCX's choice)")
    if args.ttft_model:
        results["prefill"] = prefill_time(args, src_dev, kv_cache_dtype)
    report(results)
    return results


def compare(runs: list[dict[str, Any]]) -> None:
    """Pool dtypes side by side: bytes and pull time for the same prompt."""
    base = runs[0]
    key = "pull_blocks (copy_blocks kernel)"
    print(f"\n{runs[0]['config']['prompt_tokens']}-token prompt, pull_blocks, by KV dtype "
          f"({base['dst_card']}):")
    print(f"{'KV dtype':<16}{'block MiB':>10}{'MB moved':>10}{'kernel ms':>11}{'wall ms':>9}"
          f"{'vs first':>10}")
    for r in runs:
        c, m = r["config"], r["methods"][key]
        ratio = m["median_ms"] / base["methods"][key]["median_ms"]
        print(f"{c['dtype']:<16}{c['block_bytes'] / 2**20:>10.2f}{c['bytes_moved'] / 1e6:>10.1f}"
              f"{m['median_ms']:>11.3f}{m['wall_clock_median_ms']:>9.3f}{ratio:>10.2f}")


def run(args: argparse.Namespace, desc: PoolDescriptor, src_dev: int, dst_dev: int,
        shape: dict[str, int], src_ids: list[int], dst_ids: list[int],
        dtype: str) -> dict[str, Any]:
    """The decode worker: open the producer's pool, time and check every method."""
    import cupy

    from benchmarks import cuda_batch
    from kernels.copy_blocks import copy_blocks

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

    side = torch.cuda.Stream(dev)  # the batch API refuses the legacy default stream

    def batched(flags: int) -> None:
        current = torch.cuda.current_stream(dev)
        side.wait_stream(current)
        cuda_batch.batch_copy(dst_pool.data_ptr(), src_pool.data_ptr(), dst_ids, src_ids, bb,
                              side.cuda_stream, dst_dev, flags)
        current.wait_stream(side)

    def contiguous() -> None:
        memcpy(dst_pool.data_ptr(), src_pool.data_ptr(), nbytes)

    pull_seconds: list[float] = []

    def pull() -> None:
        pull_seconds.append(pull_blocks(remote, dst_pool, src_ids, dst_ids).seconds)

    methods: dict[str, tuple[Callable[[], object], list[int], list[int]]] = {
        "pull_blocks (copy_blocks kernel)": (pull, src_ids, dst_ids),
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
    }
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
    out["pull_blocks (copy_blocks kernel)"]["wall_clock_median_ms"] = (
        statistics.median(pull_seconds[-args.repeats:]) * 1e3)  # the timed calls only
    out["pull_blocks (copy_blocks kernel)"]["launch_host_median_us"] = launch_host_us(
        remote, dst_pool, src_ids, dst_ids, args.repeats)
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
                   "blocks_moved": n, "block_bytes": bb, "bytes_moved": nbytes,
                   "warmup": args.warmup, "repeats": args.repeats, "seed": args.seed},
        "torch": torch.__version__, "cupy": cupy.__version__,
        "methods": out,
    }


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


def prefill_time(args: argparse.Namespace, device: int, kv_cache_dtype: str) -> dict[str, Any]:
    """Time to first token of the same prompt on the prefill side: the engine (role both, CUDA
    graphs) prefilling a prompt of --prompt-tokens and sampling one token, median of 5. The
    transfer happens after that first token is sent, so it delays the second token, not the
    first; the ratio says how much of a disaggregated request's start it adds."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=args.ttft_model, device=f"cuda:{device}",
                                    dtype=args.dtype, load_format="dummy",
                                    max_model_len=args.prompt_tokens + 64,
                                    max_num_batched_tokens=args.prompt_tokens,
                                    enable_prefix_caching=False, memory_fraction=0.5,
                                    kv_cache_dtype=kv_cache_dtype),
                       progress=False)
    rng = random.Random(args.seed)
    times = []
    for i in range(7):
        prompt = [rng.randrange(1, 32000) for _ in range(args.prompt_tokens)]
        t0 = time.perf_counter()
        engine.add_request(f"ttft-{i}", prompt, SamplingParams(max_tokens=1, temperature=0))
        while engine.has_work():
            engine.step()
        times.append(time.perf_counter() - t0)
    ttft = statistics.median(times[2:])
    del engine
    torch.cuda.empty_cache()
    return {"model": args.ttft_model, "prompt_tokens": args.prompt_tokens, "ttft_ms": ttft * 1e3}


def sweep_copy_configs(src_pool, dst_pool, src_t, dst_t, dev, args, nbytes
                       ) -> dict[str, dict[str, Any]]:
    """Time the copy_blocks kernel alone (no id upload, no sync) under tile configurations."""
    from kernels.copy_blocks import CopyConfig, copy_blocks

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


def report(r: dict[str, Any]) -> None:
    c = r["config"]
    print(f"src GPU {r['src_device']}: {r['src_card']}   dst GPU {r['dst_device']}: {r['dst_card']}"
          f"   peer access: {r['peer_access']}   torch {r['torch']}, cupy {r['cupy']}"
          + (f"   nixl UCX_TLS: {r['ucx_tls']}" if "ucx_tls" in r else ""))
    print(f"pool: {c['num_layers']} layers x {c['num_kv_heads']} KV heads x {c['head_dim']} "
          f"head_dim, {c['dtype']}, {c['block_size']}-token blocks = "
          f"{c['block_bytes'] / 2**20:.2f} MiB/block; {c['prompt_tokens']} tokens = "
          f"{c['blocks_moved']} blocks = {c['bytes_moved'] / 1e6:.1f} MB; producer in a separate "
          f"process; median of {c['repeats']}")
    print(f"{'method':<44} {'ms':>8} {'GB/s':>8} {'vs large':>9}  ok")
    for name, m in r["methods"].items():
        print(f"{name:<44} {m['median_ms']:>8.3f} {m['gbps']:>8.1f} {m['vs_large_copy']:>9.2f}  "
              f"{'yes' if m['correct'] else 'NO'}")
    pull = r["methods"]["pull_blocks (copy_blocks kernel)"]
    print(f"pull_blocks wall clock (ids upload + launch + sync): {pull['wall_clock_median_ms']:.3f}"
          f" ms median, of which {pull['launch_host_median_us']:.0f} µs host time to launch; "
          f"producer freed its pool on stop: {r['producer_freed_its_pool']}")
    if "prefill" in r:
        p = r["prefill"]
        share = pull["wall_clock_median_ms"] / (p["ttft_ms"] + pull["wall_clock_median_ms"])
        print(f"prefill of the same {p['prompt_tokens']}-token prompt ({Path(p['model']).name}, "
              f"time to first token): {p['ttft_ms']:.1f} ms; the pull adds "
              f"{pull['wall_clock_median_ms']:.3f} ms = {share:.1%} of first token + transfer")


if __name__ == "__main__":
    main()
