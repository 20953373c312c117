"""The soak's CI version (benchmarks/robustness/soak.py, 10 s of load, each fault a second after
the last one's recovery): a supervised 1P+2D stack under a random request mix while a worker is
hung (SIGSTOP) and another killed (SIGKILL). Nothing goes
unexplained, greedy and seeded outputs equal their fault-free runs, and every pool ends with no
block in use and no lease."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_soak_short(tiny_models, tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "robustness" / "soak.py"), "--model",
         str(tiny_models["llama"]), "--duration", "10", "--min-faults", "2", "--first-fault", "1", "--fault-interval", "1",
         "--log-dir", str(tmp_path / "logs"), "--out", str(out)],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    tail = proc.stdout[-4000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    r = json.loads(out.read_text())
    assert r["unexplained"] == [] and r["outcomes"].get("ok", 0) > 0, tail
    assert {f["kind"] for f in r["faults"]} == {"hang", "kill"}, tail
    for name, pool in r["pools"].items():
        assert pool == {"blocks_in_use": 0, "leases": 0, "running": 0, "waiting": 0}, name
    assert r["supervisor_failed"] is None and sum(r["restarts"].values()) >= 1, tail
    assert set(r["rss_mb"]["end"]) == {"prefill0", "decode0", "decode1", "router"}
