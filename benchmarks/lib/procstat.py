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
    from tandem.cli.launcher import LocalStack


def metric_totals(metrics_url: str, names: tuple[str, ...]) -> dict[str, float] | None:
    """The sum over label sets of each named sample (e.g. a histogram's `_count`) a worker's
    /metrics shows now; None if it serves no metrics."""
    try:
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    except OSError:
        return None
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def engine_steps(metrics_url: str) -> int | None:
    """Engine steps that ran the model so far: the count of a worker's
    tandem:iteration_tokens_total histogram; None if it serves no metrics."""
    t = metric_totals(metrics_url, ("tandem:iteration_tokens_total_count",))
    return None if t is None else int(t["tandem:iteration_tokens_total_count"])


KV_PULL = ("tandem:kv_transfer_seconds_sum", "tandem:kv_transfer_seconds_count",
           "tandem:kv_transfer_bytes_sum")


def kv_pulls(metrics_url: str) -> dict[str, float] | None:
    """A decode worker's KV pulls so far (seconds and bytes summed, and their number)."""
    return metric_totals(metrics_url, KV_PULL)


def kv_pull_summary(before: dict, after: dict) -> dict | None:
    """Pulls between two scrapes of every worker ({name: kv_pulls(...)}): how many, their mean
    time and size; None when none was pulled."""
    d = dict.fromkeys(KV_PULL, 0.0)
    for name, a in after.items():
        if a is not None and before.get(name) is not None:
            for k in KV_PULL:
                d[k] += a[k] - before[name][k]
    n = d["tandem:kv_transfer_seconds_count"]
    if not n:
        return None
    return {"pulls": int(n), "mean_ms": d["tandem:kv_transfer_seconds_sum"] / n * 1e3,
            "mean_mib": d["tandem:kv_transfer_bytes_sum"] / n / 2**20}


def engine_cores(pid: int) -> list[int]:
    """The engine core processes a worker started (its children run by multiprocessing's
    spawn; not its resource tracker); [] for other processes or off Linux."""
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return [int(k) for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]
    except OSError:
        return []


def api_processes(pid: int) -> list[int]:
    """The other API processes a router started (`--api-processes`: `tandem` run again)."""
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return [int(k) for k in kids
                if b"tandem.cli.main" in Path(f"/proc/{k}/cmdline").read_bytes()]
    except OSError:
        return []


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) a process, its engine core and (a router) its
    other API processes have used so far; None off Linux."""
    total = 0.0
    for p in (pid, *engine_cores(pid), *api_processes(pid)):
        try:
            fields_ = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        total += (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")
    return total


def thread_stats(pid: int) -> dict[str, dict[str, float]]:
    """A process's threads so far, and its engine core's (prefixed `core.`): CPU seconds and
    times preempted (involuntary context switches), by thread: `main`, the other Python threads
    together (`py-threads`), and native threads by name (gRPC's own)."""
    out = _threads(pid, "")
    for core in engine_cores(pid):
        out.update(_threads(core, "core."))
    return out


def _threads(pid: int, prefix: str) -> dict[str, dict[str, float]]:
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
        t = out.setdefault(prefix + name, {"cpu_s": 0.0, "preempted": 0})
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
    """--pin: this process (the client), then each worker and its engine core, then the
    router, a core each."""
    cores = {name: engine_cores(proc.popen.pid) for name, proc in stack.procs.items()}
    names = ["client"]
    for name in stack.procs:
        names += [name, *(f"{name}.core" for _ in cores[name][:1])]
    plan = pin_plan(names)
    pin(os.getpid(), plan["client"])
    for name, proc in stack.procs.items():
        pin(proc.popen.pid, plan[name])
        for core in cores[name][:1]:
            pin(core, plan[f"{name}.core"])
    return plan


def pin_plan(names: list[str]) -> dict[str, list[int]]:
    """One physical core each, in order (--pin); refused when the machine has too few."""
    cores = physical_cores()
    if len(cores) < len(names):
        raise SystemExit(f"serve.py --pin: {len(names)} processes ({', '.join(names)}) need as "
                         f"many cores; this machine lets us use {len(cores)}")
    return dict(zip(names, cores))
