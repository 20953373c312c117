"""Move the KV of one 2k-token prompt from a prefill worker's GPU to a decode worker's GPU, the
way Tandem does, against the ways it could, and against the link's bound.

Llama-3.1-8B-shaped pool: 32 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks, so one
block is 2 MiB and a 2048-token prompt is 128 blocks, 268 MB.

A producer process (the prefill worker) allocates a cuda_ipc pool on GPU 0 and fills it with a
pattern. This process (the decode worker) opens it over CUDA IPC on GPU 1, as in deployment,
and moves 128 blocks chosen by scattered ids into scattered blocks of its own pool with:

    pull_blocks              kvtransfer: one kernels.copy_blocks launch, then a stream sync
                             (and on 1 or 8 runs of adjacent blocks: one cudaMemcpyAsync per
                             run, the copy engines)
    torch index_select+copy  gather into a temporary on GPU 1, then index_copy_
    memcpy per block         one cudaMemcpyAsync per 2 MiB block (128 calls)
    memcpy per layer chunk   one per block, layer and K/V, 32 KiB each (8192 calls): what a
                             layer-major pool would need
    contiguous IPC memcpy    one cudaMemcpyAsync of 128 adjacent blocks over the IPC mapping

and, as the bound, one large peer copy: torch copy_ of a contiguous 268 MB tensor GPU 0 ->
GPU 1, measured in the same run. With --kv-cache-dtype auto fp8 the whole measurement runs for
the model dtype's pool and for an FP8 (e4m3, 1 byte an element) pool, and a last table compares
the two: an FP8 block is half the bytes, so the pull should take about half the time. Every
method's result is checked byte for byte. With one GPU, everything runs on GPU 0 and the bound
is a device-to-device copy.

Also timed: the copy_blocks kernel alone (ids already on the device; on scattered and on
adjacent blocks) and, where the driver has it, one cuMemcpyBatchAsync of all the blocks.

Times are CUDA-event medians on the decode side's stream. pull_blocks' own wall-clock seconds
(id upload, launch, sync) are reported too, and launch_pull's host time.

This file runs the producer, the dtypes and the report; the rows are measured by
benchmarks/transfer/kv_transfer_ipc.py (CUDA IPC) and benchmarks/transfer/kv_transfer_nixl.py (--nixl).

With --nixl (needs the nixl extra) a second producer process serves the same pattern from a
pool registered with NIXL (transport "nixl", VRAM on the source GPU), and this process reads the
same scattered blocks into a registered VRAM pool of its own with one NIXL READ (UCX picks the
path: cuda_ipc over NVLink between GPUs of one host, unless UCX_TLS says otherwise), as a decode
worker does with `--transport nixl`. Its rows are wall-clock medians from posting the READ to
seeing it complete: the same thing pull_blocks' wall clock measures.

    python benchmarks/transfer/kv_transfer.py --out kv_transfer.json
    python benchmarks/transfer/kv_transfer.py --nixl --out kv_transfer_nixl.json
    python benchmarks/transfer/kv_transfer.py --kv-cache-dtype auto fp8 --ttft-model \
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
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from benchmarks.transfer.kv_transfer_blocks import fill_pattern
from benchmarks.transfer.kv_transfer_ipc import PULL, PULL_ADJACENT, measure_ipc
from benchmarks.transfer.kv_transfer_nixl import measure_nixl
from tandem.kvtransfer.descriptor import PoolDescriptor
from tandem.kvtransfer.pool import TORCH_DTYPES, allocate_pool


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
        results = measure_ipc(args, desc, src_dev, dst_dev, shape, src_ids, dst_ids, dtype)
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
    """Pool dtypes side by side: bytes and pull time (device, wall) for the same prompt, its
    blocks scattered and adjacent."""
    base = runs[0]["methods"]
    print(f"\n{runs[0]['config']['prompt_tokens']}-token prompt, pull_blocks, by KV dtype "
          f"({runs[0]['dst_card']}; x: against the first dtype):")
    print("(in stream: the copies' device time when launched behind a busy stream, as a "
          "decode worker launches them; wall: launch + sync on an idle stream)")
    print(f"{'KV dtype':<16}{'MB moved':>9}" + "".join(
        f"{h:>11}" for h in ("scat. str", "x", "wall ms", "x", "adj. str", "x", "wall ms",
                             "x")))
    for r in runs:
        c, m = r["config"], r["methods"]
        cells = []
        for key in (PULL, PULL_ADJACENT):
            dev, wall = m[key]["in_stream_device_median_ms"], m[key]["wall_clock_median_ms"]
            cells += [dev, dev / base[key]["in_stream_device_median_ms"],
                      wall, wall / base[key]["wall_clock_median_ms"]]
        print(f"{c['dtype']:<16}{c['bytes_moved'] / 1e6:>9.1f}"
              + "".join(f"{x:>11.3f}" for x in cells))


def prefill_time(args: argparse.Namespace, device: int, kv_cache_dtype: str) -> dict[str, Any]:
    """Time to first token of the same prompt on the prefill side: the engine (role both, CUDA
    graphs) prefilling a prompt of --prompt-tokens and sampling one token, median of 5. The
    transfer happens after that first token is sent, so it delays the second token, not the
    first; the ratio says how much of a disaggregated request's start it adds."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams

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
    print(f"{'method':<76} {'ms':>8} {'GB/s':>8} {'vs large':>9}  ok")
    for name, m in r["methods"].items():
        print(f"{name:<76} {m['median_ms']:>8.3f} {m['gbps']:>8.1f} {m['vs_large_copy']:>9.2f}  "
              f"{'yes' if m['correct'] else 'NO'}")
    for name, m in r["methods"].items():
        if "wall_clock_median_ms" in m:
            print(f"{name}: wall clock (launch + sync) {m['wall_clock_median_ms']:.3f} ms median,"
                  f" of which {m['launch_host_median_us']:.0f} µs host time to launch; "
                  f"launched behind a busy stream: {m['in_stream_device_median_ms']:.3f} ms "
                  "on the device")
    print(f"producer freed its pool on stop: {r['producer_freed_its_pool']}")
    pull = r["methods"][PULL]
    if "prefill" in r:
        p = r["prefill"]
        share = pull["wall_clock_median_ms"] / (p["ttft_ms"] + pull["wall_clock_median_ms"])
        print(f"prefill of the same {p['prompt_tokens']}-token prompt ({Path(p['model']).name}, "
              f"time to first token): {p['ttft_ms']:.1f} ms; the pull adds "
              f"{pull['wall_clock_median_ms']:.3f} ms = {share:.1%} of first token + transfer")


if __name__ == "__main__":
    main()
