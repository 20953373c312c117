"""What benchmarks/robustness/soak.py measures besides the requests' outcomes, and its summary: the resident
memory of the stack's processes (router, each worker with its engine core), the totals of the
router's counters, and the text report of a finished soak's results."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.lib.procstat import engine_cores

if TYPE_CHECKING:
    from tandem.cli.launcher import LocalStack


def metric_total(text: str, name: str) -> float:
    """The sum over label sets of the counter `tandem:<name>_total` in a /metrics text."""
    return sum(float(v) for v in re.findall(rf"^tandem:{name}_total(?:{{[^}}]*}})? (\S+)$",
                                            text, re.M))


def rss(stack: LocalStack) -> dict[str, float]:
    """MB resident, by process: the router, and each worker with its engine core."""
    out = {}
    for name, p in stack.procs.items():
        total = 0
        for pid in (p.popen.pid, *engine_cores(p.popen.pid)):
            with contextlib.suppress(OSError):
                status = Path(f"/proc/{pid}/status").read_text()
                total += int(status.split("VmRSS:")[1].split()[0])
        out[name] = round(total / 1024, 1)
    return out


def report(r: dict, a: argparse.Namespace) -> str:
    """The summary of a finished soak's results `r` (as main prints it)."""
    o = r["outcomes"]
    lines = [f"soak: {r['elapsed_s']} s, {a.prefill_workers}P+{a.decode_workers}D on the CPU "
             f"({len(os.sched_getaffinity(0))} cores), model {a.model}",
             f"faults: {len(r['faults'])}: " + ", ".join(
                 f"{f['kind']} {f['worker']} @{f['at_s']} s" for f in r["faults"]),
             f"requests {r['requests']}: ok {o.get('ok', 0)}, cancelled {o.get('cancelled', 0)}"
             f", clear errors {o.get('clear', 0)}, unexplained {o.get('unexplained', 0)}"]
    lines += [f"  clear: {n:5} x {what}" for what, n in
              sorted(r["clear_errors"].items(), key=lambda kv: -kv[1])]
    lines += [f"  unexplained: {d}" for d in r["unexplained"][:20]]
    rt = r["router"]
    lines.append(f"router: {rt['request_migrations']:.0f} requests moved, "
                 f"{rt['worker_restarts']:.0f} worker restarts seen, "
                 f"{rt['worker_lost']:.0f} workers lost (hung); supervisor restarts "
                 f"{r['restarts']}")
    lines.append(f"{'process':10} {'blocks in use':>13} {'leases':>6} {'RSS start MB':>12} "
                 f"{'RSS end MB':>10}")
    for name, start in r["rss_mb"]["start"].items():
        pool = r["pools"].get(name, {})
        lines.append(f"{name:10} {pool.get('blocks_in_use', '-'):>13} "
                     f"{pool.get('leases', '-'):>6} {start:>12} {r['rss_mb']['end'][name]:>10}")
    return "\n".join(lines)
