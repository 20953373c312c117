"""The committed stubs are exactly what protos/generate.py produces, and they import."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "tandem" / "v1"


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "protos" / "generate.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True)
    fresh = {p.name: p.read_bytes() for p in (tmp_path / "tandem" / "v1").glob("*_pb2*.py*")}
    committed = {p.name: p.read_bytes() for p in STUBS.glob("*_pb2*.py*")}
    assert sorted(fresh) == sorted(committed)
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale stubs, run `python protos/generate.py`: {stale}"


def test_stubs_import_and_roundtrip():
    for mod in ("common_pb2", "worker_pb2", "worker_pb2_grpc", "api_pb2", "api_pb2_grpc"):
        importlib.import_module(f"tandem.v1.{mod}")
    from tandem.v1 import common_pb2

    p = common_pb2.SamplingParams(n=2, temperature=0.7, stop=["\n"])
    q = common_pb2.SamplingParams.FromString(p.SerializeToString())
    assert q.temperature == 0.7 and q.HasField("temperature") and not q.HasField("top_p")
