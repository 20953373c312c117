"""What the parts of benchmarks/kernels/paged_kernels.py share: the attention shapes (Llama-3.1-8B's, or tiny
for --smoke), timing from captured graphs over input copies that exceed the L2, the memory
check, the copy bandwidth every share is taken of, and the names the decode benchmarks give
tile configurations (`config_key`, `parse_config`).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.lib.timing import copy_bandwidth, eager_time, graph_time
from tandem.kernels.paged_decode_launch import DEFAULT_SPLIT_POLICY, DecodeConfig, SplitPolicy

L2_WORKING_SET = 256 << 20  # bytes of distinct inputs per timed graph (H100 L2: 50 MiB)


@dataclass(frozen=True)
class Shape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


LLAMA_8B = Shape(32, 8, 128, torch.bfloat16)
SMOKE = Shape(8, 2, 64, torch.float32)


# ----------------------------------------------------------------------------- config names

def config_key(cfg: DecodeConfig, policy: SplitPolicy = DEFAULT_SPLIT_POLICY) -> str:
    """A decode tile configuration's name: n<block_n>/w<warps>/s<stages>, then each that
    applies of /f16 (FP8 tiles read as fp16), /r<registers> (capped) and /m<tokens> (the split
    policy's shortest split)."""
    key = f"n{cfg.block_n}/w{cfg.num_warps}/s{cfg.num_stages}"
    if cfg.fp8_dot_f16:
        key += "/f16"
    if cfg.max_registers is not None:
        key += f"/r{cfg.max_registers}"
    if policy.min_split_tokens != DEFAULT_SPLIT_POLICY.min_split_tokens:
        key += f"/m{policy.min_split_tokens}"
    return key


def parse_config(key: str) -> tuple[DecodeConfig, SplitPolicy]:
    """The configuration and split policy `config_key` names; ValueError naming the key if it
    names none."""
    parts = key.split("/")
    try:
        prefixes = "".join(p[0] for p in parts[:3])
        if prefixes != "nws":
            raise ValueError
        n, w, s = (int(p[1:]) for p in parts[:3])
        flags = {p[0]: p[1:] for p in parts[3:]}
        if set(flags) - set("frm") or flags.get("f", "16") != "16":
            raise ValueError
        cfg = DecodeConfig(n, w, s, "f" in flags,
                           max_registers=int(flags["r"]) if "r" in flags else None)
        policy = DEFAULT_SPLIT_POLICY
        if "m" in flags:
            policy = policy._replace(min_split_tokens=int(flags["m"]))
    except (ValueError, IndexError):
        raise ValueError(f"config {key!r}: expected n<block_n>/w<warps>/s<stages>"
                         "[/f16][/r<registers>][/m<tokens>]") from None
    return cfg, policy


# ----------------------------------------------------------------------------- timing

def bench(fns: list[Callable[[], object]], device: torch.device, reps: int,
          min_calls: int = 20) -> float:
    """Seconds per call, cycling through fns (one per input copy). On CUDA the calls run
    from one captured graph; if capture fails they run eagerly (with launch overhead)."""
    for f in fns:
        f()  # compile, warm up
    calls = fns * max(1, math.ceil(min_calls / len(fns)))
    if device.type == "cuda":
        try:
            return graph_time(calls, reps)
        except RuntimeError as e:  # a path that cannot be captured
            print(f"  (graph capture failed, timing eagerly: {str(e).splitlines()[0]})")
            torch.cuda.synchronize()
    return eager_time(calls, max(1, reps // 3) if device.type == "cpu" else reps, device)


def copies_for(nbytes: int) -> int:
    """How many copies of an input of nbytes make the timed working set exceed the L2."""
    if not torch.cuda.is_available():
        return 1
    return max(1, min(32, math.ceil(L2_WORKING_SET / max(nbytes, 1))))


def fits(nbytes: int, device: torch.device, slack: int = 2 << 30) -> bool:
    if device.type != "cuda":
        return nbytes < (4 << 30)
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes + slack < free


# ----------------------------------------------------------------------------- copy bandwidth

def copy_bound(device: torch.device, reps: int, smoke: bool) -> dict[str, float]:
    nbytes = (16 << 20) if smoke else (1 << 30)
    gbps = copy_bandwidth(device, nbytes, max(3, reps // 4))
    return {"bytes": nbytes, "seconds": 2 * nbytes / gbps / 1e9, "gbps": gbps}


# ----------------------------------------------------------------------------- sweeps' flags

def add_sweep_args(p: argparse.ArgumentParser, batches: list[int], contexts: list[int]) -> None:
    """The flags of a sweep over batch x context (decode_kv_dtype.py, decode_tiles.py)."""
    p.add_argument("--batches", type=int, nargs="+", default=batches)
    p.add_argument("--contexts", type=int, nargs="+", default=contexts)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: the interpreter)")
    p.add_argument("--out", type=Path)


def sweep_device() -> tuple[torch.device, str]:
    """The GPU if there is one (else the CPU) and its name."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return device, torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
