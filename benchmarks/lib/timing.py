"""Timing helpers shared by the GPU benchmarks, so every script measures its bound the same way.

- copy_bandwidth: one large device-to-device copy, (bytes read + bytes written) / time, eager
  (a copy captured in a CUDA graph measured ~35% slower on an H200, which would flatter every
  share of it);
- graph_time: seconds per call of a list of calls replayed from one CUDA graph (no launch
  overhead), median over replays;
- eager_time: the same without a graph (CPU, or paths that cannot be captured).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

import torch


def gpu_or_smoke(smoke: bool) -> None:
    """Before Triton is imported: stop without a GPU unless this is a --smoke run, which then
    runs the kernels in Triton's interpreter on the CPU."""
    if not torch.cuda.is_available():
        if not smoke:
            sys.exit("no CUDA device: run on a GPU, or pass --smoke (CPU, interpreter)")
        os.environ.setdefault("TRITON_INTERPRET", "1")

def eager_time(calls: list[Callable[[], object]], reps: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        for f in calls:
            f()
        sync()
        times.append((time.perf_counter() - t0) / len(calls))
    return statistics.median(times)


def graph_time(calls: list[Callable[[], object]], reps: int) -> float:
    """Warm up on a side stream, capture all calls in one graph, time its replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in calls:
            f()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(calls))
    del graph
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 5) -> float:
    """GB/s of one large device-to-device copy, read + write counted."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = eager_time([lambda: dst.copy_(src)] * 10, reps, device)
    return 2 * nbytes / t / 1e9


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in float32."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
