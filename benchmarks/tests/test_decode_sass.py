"""benchmarks/kernels/decode_sass.py on the CPU: the decode kernel compiled for sm_90 with the
launch's specialisations, read back from its cubin. The engine's FP8 tiles keep their register
cap without spilling, and bf16's tiles copy 16 bytes at a time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "kernels" / "decode_sass.py"


def sass(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=300)


def report(*args: str) -> dict:
    proc = sass(*args, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_fp8_default_tiles_hold_their_register_cap_without_spills():
    r = report("--kv", "fp8", "--config", "n128/w4/s3/f16/r160")
    assert 0 < r["registers"] <= 160 and r["stack_bytes"] == 0, r
    assert any(op.startswith("LDGSTS") for op in r["memory_ops"]), r  # tiles copied ahead
    assert any(op.startswith("LDSM") for op in r["memory_ops"]), r  # K's tiles by ldmatrix


def test_bf16_tiles_copy_sixteen_bytes_at_a_time(tmp_path):
    out = tmp_path / "bf16.sass"
    r = report("--kv", "bf16", "--config", "n32/w2/s2", "--sass", str(out))
    copies = {op: n for op, n in r["memory_ops"].items() if op.startswith("LDGSTS")}
    assert copies and all(op.endswith(".128") for op in copies), r
    assert r["stack_bytes"] == 0, r
    assert "LDGSTS" in out.read_text()


def test_a_config_it_cannot_read_is_refused_naming_the_flag():
    proc = sass("--config", "n128-w4")
    assert proc.returncode == 2 and "--config" in proc.stderr, proc.stderr
