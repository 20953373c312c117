"""What the processes of a benchmark run cost and where they run: CPU time per process and per
thread from /proc, engine steps from a worker's metrics, and pinning processes to physical
cores (Linux)."""

from __future__ import annotations

import contextlib
import os
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router_svc.launcher import LocalStack


def engine_steps(metrics_url: str) -> int | None:
    """Engine steps that ran the model so far: the count of a worker's
    tandem:iteration_tokens_total histogram; None if it serves no metrics."""
    try:
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    except OSError:
        return None
    counts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("tandem:iteration_tokens_total_count")]
    return int(sum(counts)) if counts else None


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) a process has used so far; None off Linux."""
    try:
        fields_ = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")


def thread_stats(pid: int) -> dict[str, dict[str, float]]:
    """A process's threads so far: CPU seconds and times preempted (involuntary context
    switches), by thread: `main`, `engine` (a worker's engine thread, named so), the other
    Python threads together (`py-threads`), and native threads by name (gRPC's own)."""
    out: dict[str, dict[str, float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
        main_comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return out
    for tid in tids:
        try:
            comm, rest = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue  # ended meanwhile
        comm = comm.split("(", 1)[1]
        f = rest.split()
        name = "main" if tid == str(pid) else "py-threads" if comm == main_comm else comm
        t = out.setdefault(name, {"cpu_s": 0.0, "preempted": 0})
        t["cpu_s"] += (int(f[11]) + int(f[12])) / tick
        t["preempted"] += int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
    return out


def thread_deltas(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
                  ) -> dict[str, dict[str, float]]:
    return {name: {k: v - before.get(name, {}).get(k, 0) for k, v in t.items()}
            for name, t in after.items()}


def physical_cores() -> list[list[int]]:
    """This machine's cores in order, each as the CPUs (hyperthreads) it runs, from sysfs; the
    CPUs this process may use only."""
    allowed = os.sched_getaffinity(0)
    cores: dict[str, list[int]] = {}
    for cpu in sorted(allowed):
        try:
            sib = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
                       ).read_text().strip()
        except OSError:
            sib = str(cpu)
        cores.setdefault(sib, []).append(cpu)
    return list(cores.values())


def pin(pid: int, cpus: list[int]) -> None:
    """Every thread of a process (and so the threads it starts later) onto these CPUs."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cpus)


def pin_stack(stack: LocalStack) -> dict[str, list[int]]:
    """--pin: this process (the client), then each worker, then the router, a core each."""
    plan = pin_plan(["client", *stack.procs])
    pin(os.getpid(), plan["client"])
    for name, proc in stack.procs.items():
        pin(proc.popen.pid, plan[name])
    return plan


def pin_plan(names: list[str]) -> dict[str, list[int]]:
    """One physical core each, in order (--pin); refused when the machine has too few."""
    cores = physical_cores()
    if len(cores) < len(names):
        raise SystemExit(f"serve.py --pin: {len(names)} processes ({', '.join(names)}) need as "
                         f"many cores; this machine lets us use {len(cores)}")
    return dict(zip(names, cores))
