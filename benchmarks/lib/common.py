"""What the serving benchmarks share: the statistics they report, the flags that name a model and
its devices, the warm-up requests, and how a report is written (JSON and an optional plot).
Used by serve.py (the load generator: serve_client.py, serve_runs.py), offline.py (the offline
profiler), ratio.py, worker_stream.py and hf_baseline.py. The workloads themselves are in workloads.py."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

from benchmarks.lib.workloads import Request, build_workload

ITL_STATS = ("max", "p99", "p90", "p50", "mean")


# -- statistics ----------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), None when empty."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def dist(values: list[float]) -> dict:
    """mean, p50, p90, p99, max of a sample (None when empty)."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None, "n": 0}
    return {"mean": sum(values) / len(values), "p50": percentile(values, 50),
            "p90": percentile(values, 90), "p99": percentile(values, 99), "max": max(values),
            "n": len(values)}


def itl_stat(gaps: list[float], which: str) -> float:
    """One of ITL_STATS over a request's inter-token gaps (0 with no gap)."""
    if not gaps:
        return 0.0
    if which == "max":
        return max(gaps)
    if which == "mean":
        return sum(gaps) / len(gaps)
    return percentile(gaps, float(which[1:]))


# -- formatting ----------------------------------------------------------------------------------
def fmt(x, spec: str = ".1f") -> str:
    """A number for a table; '-' for None and NaN."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def fmt_rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def parse_rate(s: str) -> float:
    return float("inf") if s.lower() in ("inf", "infinity") else float(s)


def progress_bar(total: int, desc: str, enabled: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True, leave=False,
                disable=not enabled)


# -- devices -------------------------------------------------------------------------------------
_TORCH_NAMES = ("import torch\nfor i in range(torch.cuda.device_count()):\n"
                "    print(f'{i}, {torch.cuda.get_device_name(i)}')")


def cuda_names() -> dict[int, str]:
    """GPU index -> name as the workers will see them, from nvidia-smi or else from torch in a
    child process (this one stays without a CUDA context, which would take GPU memory)."""
    cmds = [[sys.executable, "-c", _TORCH_NAMES]]
    if not os.environ.get("CUDA_VISIBLE_DEVICES"):  # nvidia-smi ignores it
        cmds.insert(0, ["nvidia-smi", "--query-gpu=index,name", "--format=csv,noheader"])
    for cmd in cmds:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                                 check=True).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        names = {}
        for line in out.strip().splitlines():
            idx, _, name = line.partition(",")
            if idx.strip().isdigit():
                names[int(idx)] = name.strip()
        return names
    return {}


def device_name(device: str, names: dict[int, str] | None = None) -> str:
    if not device.startswith("cuda"):
        return "cpu"
    names = cuda_names() if names is None else names
    idx = int(device.partition(":")[2] or 0)
    return names.get(idx, device)


def resolve_devices(spec: str, n: int) -> list[str]:
    """One device per worker. spec: comma-separated devices, one per worker in the order
    prefill..., decode..., both...; a single device is shared by all; `auto`: cuda:0..n-1 when
    there are n GPUs, else cpu."""
    if spec == "auto":
        count = len(cuda_names())
        return [f"cuda:{i}" for i in range(n)] if count >= n else ["cpu"] * n
    devs = [d.strip() for d in spec.split(",") if d.strip()]
    if len(devs) == 1:
        return devs * n
    if len(devs) < n:
        raise SystemExit(f"{n} workers need {n} devices, --devices names {len(devs)}")
    return devs[:n]


# -- flags ---------------------------------------------------------------------------------------
def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the script's flags, the engine flags after `--`)."""
    if "--" in argv:
        k = argv.index("--")
        return argv[:k], argv[k + 1:]
    return argv, []


def add_stack_args(p: argparse.ArgumentParser, devices: bool = True) -> None:
    """The model and where it runs. devices: also --devices (ratio.py places workers itself)."""
    g = p.add_argument_group("model and devices (--launch, --mode offline)")
    g.add_argument("--model", default=None,
                   help="checkpoint or config directory, or tandem-demo (for --target: only to "
                        "read the vocabulary; GetModelInfo otherwise)")
    g.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    g.add_argument("--max-model-len", type=int, default=4096)
    if devices:
        g.add_argument("--devices", default="auto",
                       help="comma-separated, one per worker in the order prefill, decode, both "
                            "(e.g. cuda:0,cuda:1); one device is shared by all; auto: cuda:0.. "
                            "if there are enough GPUs, else cpu")
    g.add_argument("--log-dir", type=Path, default=None, help="worker and router logs")


def add_warmup_arg(g) -> None:
    g.add_argument("--warmup", type=int, default=4,
                   help="requests (workload-shaped, at most 16 tokens out) sent first, unmeasured")


def add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=None, help="JSON results")
    g.add_argument("--plot", type=Path, default=None,
                   help="PNG of latency CDFs (and goodput vs rate); default: --out with .png")
    g.add_argument("--label", default="", help="a name for this configuration in the report")
    g.add_argument("--no-progress", dest="progress", action="store_false")


# -- the model and the workload ------------------------------------------------------------------
def model_vocab(model: str) -> tuple[int, int]:
    """The model's vocabulary size and max_model_len, from its config."""
    from tandem.engine.config import ModelConfig
    from tandem.engine.model_source import resolve_model

    cfg = ModelConfig.from_dir(resolve_model(model))
    return cfg.vocab_size, cfg.max_model_len


def check_lengths(requests: list[Request], max_model_len: int) -> None:
    long = [i for i, r in enumerate(requests) if len(r.prompt) + r.max_tokens > max_model_len]
    if long:
        r = requests[long[0]]
        raise SystemExit(f"{len(long)} requests exceed max_model_len {max_model_len} "
                         f"(e.g. #{long[0]}: {len(r.prompt)} + {r.max_tokens}); raise "
                         "--max-model-len or shorten the workload")


def warmup_requests(a: argparse.Namespace, vocab: int) -> list[Request]:
    """--warmup requests shaped like the workload (another seed), at most 16 tokens out."""
    if not a.warmup:
        return []
    saved = a.num_requests
    a.num_requests = a.warmup
    try:
        reqs = build_workload(a, vocab, seed=a.seed + 7919)
    finally:
        a.num_requests = saved
    return [Request(r.prompt, min(r.max_tokens, 16)) for r in reqs]


# -- reports -------------------------------------------------------------------------------------
def strip_private(obj):
    """For JSON: keys starting with _ dropped, inf and NaN as strings."""
    if isinstance(obj, dict):
        return {k: strip_private(v) for k, v in obj.items() if not k.startswith("_")}
    if isinstance(obj, list):
        return [strip_private(v) for v in obj]
    if isinstance(obj, float) and (math.isinf(obj) or math.isnan(obj)):
        return str(obj)
    return obj


def environment() -> dict:
    env = {"python": sys.version.split()[0], "host_cpus": os.cpu_count()}
    import importlib.metadata as md

    for pkg in ("torch", "transformers", "grpcio", "triton"):
        with contextlib.suppress(md.PackageNotFoundError):
            env[pkg] = md.version(pkg)
    return env


def write_report(report: dict, a: argparse.Namespace, plot_rows: list[dict], title: str) -> None:
    """The report to --out (JSON), latency CDFs to --plot (default: --out with .png)."""
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(strip_private(report), indent=1))
        print(f"wrote {a.out}")
    png = a.plot or (a.out.with_suffix(".png") if a.out else None)
    if png:
        from benchmarks.lib.plotting import latency_cdfs

        why = latency_cdfs(plot_rows, png, f"{title} on {report['card']}")
        print(why or f"wrote {png}")


async def counters(stack) -> dict[str, int]:
    """Every worker's counters (GetLoad), summed: KV bytes, blocks and copies (runs) the
    decode workers pulled, prompt tokens the prefill workers computed, blocks the workers
    copied back from their host KV tiers."""
    from tandem.v1 import worker_pb2, worker_pb2_grpc

    out = {"bytes": 0, "blocks": 0, "runs": 0, "seconds": 0.0, "computed": 0, "restored": 0}
    for name, p in stack.procs.items():
        if name == "router":
            continue
        async with stack.worker_channel(p) as ch:
            load = await worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(),
                                                                timeout=30)
        out["bytes"] += load.kv_bytes_pulled
        out["blocks"] += load.kv_blocks_pulled
        out["runs"] += load.kv_runs_pulled
        out["seconds"] += load.kv_pull_seconds
        out["restored"] += load.host_kv_blocks_restored
        if load.role == "prefill":
            out["computed"] += load.prompt_tokens_computed
    return out
