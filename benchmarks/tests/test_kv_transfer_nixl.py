"""benchmarks/transfer/kv_transfer_nixl.py on the CPU: NIXL agents over UCX held to the loopback
device, DRAM pools."""

from __future__ import annotations

import argparse
import os
import random

import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # before any agent exists: loopback only
pytest.importorskip("nixl._api", reason="the nixl package is not installed: pip install "
                                       "'tandem[nixl]'")

from benchmarks.transfer.kv_transfer_nixl import measure_nixl

SHAPE = dict(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)


def test_the_benchmarks_nixl_rows_move_the_right_bytes_on_the_cpu() -> None:
    """kv_transfer.py --nixl runs unattended on a GPU box; its producer process and READ and
    WRITE loops (kv_transfer_nixl.py) are the same code on host memory, checked here (the WRITE
    rows read back what they wrote)."""
    shape = dict(num_blocks=32, **SHAPE)
    rng = random.Random(1)
    rows = measure_nixl(argparse.Namespace(warmup=1, repeats=2, seed=0), "cpu", "cpu", shape,
                        "bfloat16", rng.sample(range(32), 16), rng.sample(range(32), 16))
    names = {"nixl READ, scattered blocks (NixlRemotePool.pull)",
             "nixl READ, adjacent blocks, one descriptor each", "nixl READ, 8 runs of 2 blocks",
             "nixl READ, adjacent blocks (1 run: one descriptor)",
             "nixl WRITE, scattered blocks (NixlRemotePool.push)",
             "nixl WRITE, 8 runs of 2 blocks", "nixl WRITE, adjacent blocks (1 run: one descriptor)"}
    assert set(rows) == {f"{n} [{label}]" for n in names
                         for label in ("progress thread", "no progress thread",
                                       "4 posting threads")}
    assert all(r["correct"] and r["gbps"] > 0 for r in rows.values()), rows
