"""The chaos probe's CI version (benchmarks/robustness/chaos.py): a supervised 1P+2D stack under steady
load while workers are killed, hung and drained at random, one at a time. No request is lost
(each finishes whole, equal to its fault-free run), every kind of fault happened, and every
pool ends with no block in use, no lease and no request."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_chaos_short(tiny_models, tmp_path):
    out = tmp_path / "chaos.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "robustness" / "chaos.py"), "--model",
         str(tiny_models["llama"]), "--duration", "10", "--min-faults", "3", "--first-fault", "1", "--fault-interval", "1",
         "--max-duration", "240", "--seed", "2", "--log-dir", str(tmp_path / "logs"),
         "--out", str(out)],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    tail = proc.stdout[-4000:] + proc.stderr[-3000:]
    assert out.exists(), tail
    r = json.loads(out.read_text())
    # what each lost request got (its status and detail), beside the run's own output
    assert r["lost"] == [] and r["ok"] > 0, f"lost: {r['lost'][:10]}\n{tail}"
    assert {f["kind"] for f in r["faults"]} == {"kill", "hang", "drain"}, tail
    for name, pool in r["pools"].items():
        assert pool == {"blocks_in_use": 0, "leases": 0, "running": 0, "waiting": 0}, name
    assert r["supervisor_failed"] is None, tail
    assert proc.returncode == 0, tail
