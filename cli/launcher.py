"""Local stacks: workers and a router as OS processes on this machine.

`LocalStack` is the one process manager that `tandem up`, the serving benchmarks and the
integration tests share. Each process is started with the `tandem` CLI, picks a free port and
writes it to a ready file; workers come up first, then the router in front of them. Stopping
sends SIGTERM to the router first (it drains its streams), then to the workers.

No process outlives the one that started the stack, however that one ends: each child gets
SIGTERM (and drains) when its parent dies, SIGKILL included (runtime/lifeline.py), and a worker's
engine core and tensor-parallel ranks die with their worker. The throwaway cluster CA's files
never stay on disk: they live in anonymous memory files that every process reads as /dev/fd/N.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tandem.engine.model_source import resolve_model
from tandem.runtime.lifeline import lifeline_env
from tandem.runtime.security import API_KEY_ENV, API_KEY_FILE_ENV, ClusterTls

STARTUP_TIMEOUT_S = 900  # a large checkpoint can take minutes to load
ROLE_FLAGS = {"prefill": "--prefill", "decode": "--decode", "both": "--workers"}


class StartInterrupted(RuntimeError):
    """start() gave up: `interrupted` said so (a signal), not a process that failed."""


@dataclass
class Proc:
    name: str  # prefill0, decode1, both0, router
    popen: subprocess.Popen
    ready_file: Path
    log: Path | None
    address: str = ""  # 127.0.0.1:<gRPC port>, once ready
    http_port: int = 0  # the router's
    metrics_port: int = 0  # a worker's, when the stack was started with metrics=True
    argv: tuple[str, ...] = ()  # the `tandem` command line it was started with

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log and self.log.exists() else ""

    @property
    def metrics_url(self) -> str:
        """Prometheus metrics: a worker's --metrics-port, the router's HTTP port."""
        return f"http://127.0.0.1:{self.metrics_port or self.http_port}/metrics"


def cpu_threads_each(num_engine_cores: int) -> int:
    """torch threads for each of the engine cores that compute on this machine's CPUs:
    OMP_NUM_THREADS where the environment sets it, else its share of the cores this process
    may run on. Each core would otherwise start a thread per CPU, and threads that spin between
    parallel regions on oversubscribed cores stalled every step of a two-decode-worker stack on
    two cores for seconds (0.3 s became 5-17 s)."""
    with contextlib.suppress(ValueError):
        if (threads := int(os.environ.get("OMP_NUM_THREADS", ""))) > 0:
            return threads
    return max(1, len(os.sched_getaffinity(0)) // max(1, num_engine_cores))


# Ports free_port() has handed out in this process: not handed out again while it lives.
_handed_out: set[int] = set()
# Below the kernel's ephemeral range (Linux's default starts at 32768): a port picked there is
# never taken in the meantime as the source port of an outgoing connection or by a server
# binding port 0, as one from bind(("127.0.0.1", 0)) can be (a worker started later on it then
# failed with "Address already in use" under a busy test run).
PICK_RANGE = (20000, 32767)
# Where free_port picks instead, "LOW-HIGH": for processes that start stacks side by side on one
# machine (the test suite's parallel runners), each given a range of its own, so that no two
# hand out the same port before its process binds it.
PORT_RANGE_ENV = "TANDEM_PORT_RANGE"


def port_range() -> tuple[int, int]:
    """free_port's range: PORT_RANGE_ENV's when set, else PICK_RANGE below the ephemeral range
    when the kernel says where that starts (an empty range: none)."""
    if spec := os.environ.get(PORT_RANGE_ENV):
        try:
            low, high = (int(x) for x in spec.split("-"))
        except ValueError:
            raise ValueError(f"{PORT_RANGE_ENV} must be LOW-HIGH, got {spec!r}") from None
        if not 1024 <= low <= high <= 65535:
            raise ValueError(f"{PORT_RANGE_ENV} must be LOW-HIGH within 1024-65535, got {spec!r}")
        return low, high
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 0
    return PICK_RANGE[0], min(PICK_RANGE[1], ephemeral - 1)


def free_port() -> int:
    """A port nothing listens on now, for a process started later to bind, from port_range()
    (any free port when that is empty or full), never one handed out before."""
    low, high = port_range()
    if high >= low:
        rng = random.Random()
        for _ in range(200):
            port = rng.randint(low, high)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket() as s:  # no room below the ephemeral range: any free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _handed_out.add(port)
    return port


class LocalStack:
    """Workers (role and device each) and a router in front of them.

    worker_args go to every worker and role_args[role] to that role's workers after them (the
    last flag wins); router_args go to the router, ports included. Output goes to
    `log_dir/<name>.log`, and with echo=True also to this process's stdout, prefixed by name.
    With metrics=True every worker serves Prometheus metrics: worker i (in `roles` order) on
    metrics_port_base + i, or on a free port when metrics_port_base is 0."""

    proc_class: type[Proc] = Proc

    def __init__(self, model: str, roles: Sequence[str], devices: Sequence[str], *,
                 worker_args: Sequence[str] = (),
                 role_args: Mapping[str, Sequence[str]] | None = None,
                 router_args: Sequence[str] = (), log_dir: Path | str | None = None,
                 echo: bool = False, env: Mapping[str, str] | None = None,
                 grace: float = 5.0, metrics: bool = False,
                 metrics_port_base: int = 0, cluster_ca: bool = False,
                 elastic: bool = False) -> None:
        if len(roles) != len(devices):
            raise ValueError(f"{len(roles)} workers but {len(devices)} devices")
        self.model = model
        self.roles = list(roles)
        self.devices = list(devices)
        self.worker_args = list(worker_args)
        self.role_args = {r: list(a) for r, a in (role_args or {}).items()}
        self.router_args = list(router_args)
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="tandem-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.echo = echo
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        # The router's: workers never check an API key, so they are never handed one.
        self.worker_env = {k: v for k, v in self.env.items()
                           if k not in (API_KEY_ENV, API_KEY_FILE_ENV)}
        self.grace = grace
        self.metrics = metrics
        self.metrics_port_base = metrics_port_base
        # cluster_ca: start() makes a throwaway cluster CA (cli/certs.py), a certificate for
        # each process's role and name, and every hop between the stack's processes is mutual
        # TLS with it. cluster_tls: the router's (what a tool that calls workers presents).
        self.cluster_ca = cluster_ca
        self.cluster_tls: ClusterTls | None = None
        self._certs: ThrowawayCa | None = None  # its files, which stop() removes
        # elastic: workers may change role while the stack runs (Supervisor.convert). The
        # router then learns them from a file this stack rewrites (router_svc/membership.py),
        # not from flags, and every worker slot has a certificate for either role.
        self.elastic = elastic
        self.workers_file = self.log_dir / "workers" if elastic else None
        # elastic: each worker's name in its other role (decode1 <-> prefill1), for its life
        # (start() hands them out): the certificate it holds for a role change in place, and
        # its name once changed, in place or by a restart.
        self.other_names: dict[str, str] = {}
        self.procs: dict[str, Proc] = {}
        self._echo_labels: dict[int, list[str]] = {}  # pid -> its output's prefix (echo=True)
        self.supervisor: Any = None  # the Supervisor that started on this stack, if any
        # Whether to give up starting (a signal, `tandem up`'s output gone): start() raises.
        self.interrupted: Callable[[], bool] = lambda: False
        # Workers on the CPU divide its cores (an explicit --cpu-threads in worker_args wins).
        self.cpu_threads = cpu_threads_each(self.devices.count("cpu"))

    # -- processes ---------------------------------------------------------------------------
    def spawn(self, name: str, argv: Sequence[str], metrics_port: int = 0,
              append: bool = False) -> Proc:
        """Start `tandem argv` as process `name`; `append`: add to its log (a restart)."""
        ready = self.log_dir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        log = self.log_dir / f"{name}.log"
        cmd = [sys.executable, "-m", "tandem.cli.main", *argv, "--ready-file", str(ready)]
        if metrics_port:
            cmd += ["--metrics-port", str(metrics_port)]
        # Own session: a terminal's Ctrl-C reaches the launcher, which stops everyone in order.
        # The CA's certificate and this process's own certificate and key (memory files) are
        # the only descriptors the child inherits: no process holds another role's key.
        # It dies with this process (runtime/lifeline.py).
        env = {**(self.env if name == "router" else self.worker_env), **lifeline_env()}
        fds = self._certs.fds(name) if self._certs else ()
        if self._certs and name in self.other_names:  # its other role's certificate and key
            fds = (*fds, *self._certs.fds(self.other_names[name])[1:])
        how = {"env": env, "start_new_session": True, "pass_fds": fds}
        if self.echo:
            popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1, **how)
            label = self._echo_labels[popen.pid] = [name]  # renamed by a role change
            threading.Thread(target=_pump, args=(label, popen.stdout, log, append),
                             daemon=True).start()
        else:
            with open(log, "a" if append else "w") as f:
                popen = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, **how)
        proc = self.procs[name] = self.proc_class(name, popen, ready, log,
                                                  metrics_port=metrics_port, argv=tuple(argv))
        return proc

    def restart(self, name: str) -> Proc:
        """Start process `name` again as it was started, on the ports it had (the router's
        worker list and the peers' stay valid). Returns at once; `read_ready` says when."""
        old = self.procs[name]
        return self.spawn(name, _pin_ports(old), old.metrics_port, append=True)

    def read_ready(self, p: Proc) -> bool:
        """Whether `p` wrote its ready file; if so, its ports are read into it."""
        if not p.ready_file.exists():
            return False
        ports = p.ready_file.read_text().split()
        p.address = f"127.0.0.1:{ports[0]}"
        p.http_port = int(ports[1]) if len(ports) > 1 else 0
        return True

    def wait_ready(self, procs: Sequence[Proc], timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        for p in procs:
            while not self.read_ready(p):
                if self.interrupted():
                    raise StartInterrupted("stopped while starting")
                if p.popen.poll() is not None:
                    raise RuntimeError(f"{p.name} exited with {p.popen.returncode} while "
                                       f"starting; log {p.log}:\n{_tail(p.log_text())}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{p.name} did not become ready in {timeout:.0f}s; log "
                                       f"{p.log}:\n{_tail(p.log_text())}")
                time.sleep(0.05)

    def start(self) -> LocalStack:
        # The checkpoint is resolved here first (a GGUF file's or a packaged model's directory is
        # built on first use): once, not by every worker and the router at the same time, and a
        # model that cannot be had fails before any process starts (ModelLoadError).
        resolve_model(self.model)
        names = self._worker_names()
        if self.elastic and not set(self.roles) <= {"prefill", "decode"}:
            raise ValueError(f"role changes take prefill and decode workers, got {self.roles}")
        if self.cluster_ca and self._certs is None:
            # A certificate for each process, for its role and under its name; an elastic
            # stack's worker takes any name prefillK or decodeK (K < its number of workers).
            members = dict(zip(names, self.roles))
            if self.elastic:
                members = {f"{r}{k}": r for r in ("prefill", "decode")
                           for k in range(len(names))}
            self._certs = ThrowawayCa({"router": "router", **members})
            self.cluster_tls = self._certs.tls("router")
        if self.elastic:
            self.other_names = _other_names(names, self.roles)

        # Workers sharing a GPU size their KV pools from its free memory: start those in turn.
        cuda = [d for d in self.devices if d.startswith("cuda")]
        one_by_one = len(cuda) != len(set(cuda))
        workers: list[tuple[str, Proc]] = []
        for name, role, device in zip(names, self.roles, self.devices):
            w = self.spawn(name, self.worker_argv(name, role, device),
                           self._metrics_port(len(workers)))
            workers.append((role, w))
            if one_by_one:
                self.wait_ready([w])
        self.wait_ready([w for _, w in workers])
        argv = ["router", "--model", self.model, "--grace", str(self.grace),
                *self._tls_argv("router")]
        if self.workers_file is not None:
            self.write_workers_file()
            # Re-read four times a second (a small file): a worker that changed role is
            # routed to within about that and the router's next poll of it.
            argv += ["--workers-file", str(self.workers_file), "--membership-interval", "0.25"]
        else:
            for role, w in workers:
                argv += [ROLE_FLAGS[role], w.address]
        self.wait_ready([self.spawn("router", [*argv, *self.router_args])])
        return self

    def _tls_argv(self, name: str) -> list[str]:
        return self._certs.tls(name).argv() if self._certs else []

    def worker_argv(self, name: str, role: str, device: str) -> list[str]:
        """The `tandem worker` command line of worker `name` (its certificate's name)."""
        argv = ["worker", "--role", role, "--device", device, "--model", self.model,
                "--port", "0", "--grace", str(self.grace)]
        if device == "cpu":
            argv += ["--cpu-threads", str(self.cpu_threads)]
        if self._certs and name in self.other_names:  # it may change role in place
            other = self._certs.tls(self.other_names[name])
            argv += ["--cluster-switch-cert", str(other.cert), "--cluster-switch-key",
                     str(other.key)]
        return [*argv, *self._tls_argv(name), *self.worker_args, *self.role_args.get(role, ())]

    # -- role changes (elastic stacks) -------------------------------------------------------
    def write_workers_file(self, without: str | None = None) -> None:
        """The router's --workers-file: every worker that has an address, but `without`
        (one being drained). Written whole, then renamed: the router never reads half."""
        assert self.workers_file is not None, "not an elastic stack"
        lines = [f"{p.name.rstrip('0123456789')} {p.address}\n" for p in self.workers()
                 if p.address and p.name != without]
        tmp = self.workers_file.with_name(self.workers_file.name + ".tmp")
        tmp.write_text("".join(lines))
        os.replace(tmp, self.workers_file)

    def replace_worker(self, name: str, role: str) -> Proc:
        """Start worker `name` (which has exited) again as a `role` worker on its device, under
        its name in that role and on a new port, in its place in the stack.
        Returns at once; `read_ready` says when it is up."""
        old = self.procs[name]
        assert old.popen.poll() is not None, f"{name} still runs"
        new_name = self._rename(name, role)
        index = self._worker_names_now().index(new_name)
        proc = self.spawn(new_name, self.worker_argv(new_name, role, self.devices[index]),
                          old.metrics_port)
        self.procs[new_name] = proc
        return proc

    def switched_worker(self, name: str, role: str, address: str) -> Proc:
        """Worker `name` changed role in place (SwitchRole) and serves as a `role` worker at
        `address`: the same process, under its name in that role, in its place in the stack;
        its command line now the role's, on that port (a restart starts it so)."""
        old = self.procs[name]
        new_name = self._rename(name, role)
        index = self._worker_names_now().index(new_name)
        proc = self.proc_class(new_name, old.popen, old.ready_file, old.log, address,
                               metrics_port=old.metrics_port)
        self._echo_labels.get(old.popen.pid, [""])[0] = new_name
        proc.argv = tuple(_pin_ports(dataclasses.replace(
            proc, argv=tuple(self.worker_argv(new_name, role, self.devices[index])))))
        self.procs[new_name] = proc
        return proc

    def _rename(self, name: str, role: str) -> str:
        """Worker `name` becomes a `role` worker: its name in that role, in its place in the
        order (devices and roles stay aligned with workers())."""
        names = self._worker_names_now()
        index = names.index(name)
        new_name = self.other_names.pop(name, None) or next(
            f"{role}{k}" for k in range(len(names) + 1) if f"{role}{k}" not in self.procs)
        self.other_names[new_name] = name
        self.procs = {(new_name if n == name else n): p for n, p in self.procs.items()
                      if n != new_name}
        self.roles[index] = role
        return new_name

    def _worker_names_now(self) -> list[str]:
        """The workers' names, in their order (aligned with `roles` and `devices`)."""
        return [n for n in self.procs if n != "router"]

    def _worker_names(self) -> list[str]:
        """prefill0, prefill1, decode0, ...: each worker's name, in `roles` order."""
        counts: dict[str, int] = {}
        names = []
        for role in self.roles:
            counts[role] = counts.get(role, -1) + 1
            names.append(f"{role}{counts[role]}")
        return names

    def _metrics_port(self, index: int) -> int:
        if not self.metrics:
            return 0
        return self.metrics_port_base + index if self.metrics_port_base else free_port()

    @property
    def cluster_certs(self) -> ThrowawayCa | None:
        """The stack's certificates while it runs (`.tls(name)`: a process's, by its name)."""
        return self._certs

    @property
    def router(self) -> Proc:
        return self.procs["router"]

    def workers(self, role: str | None = None) -> list[Proc]:
        return [p for n, p in self.procs.items()
                if n != "router" and (role is None or n.rstrip("0123456789") == role)]

    def worker_channel(self, p: Proc, options: Sequence[tuple[str, object]] = ()):
        """A channel to worker `p` as the router reaches it: with the router's certificate when
        the stack has a cluster CA, accepting only a certificate of p's role."""
        from tandem.runtime.security import internal_channel  # noqa: PLC0415 - gRPC

        return internal_channel(p.address, self.cluster_tls, options,
                                p.name.rstrip("0123456789"))

    def any_exited(self) -> Proc | None:
        return next((p for p in self.procs.values() if p.popen.poll() is not None), None)

    def stop(self, timeout: float | None = None) -> dict[str, int | None]:
        """SIGTERM, router first, then the workers; their exit codes (None: had to be killed).
        A supervisor stops first: nothing is restarted from here on."""
        if self.supervisor is not None:
            self.supervisor.stop()
        wait = self.grace + 15 if timeout is None else timeout
        codes: dict[str, int | None] = {}
        router = [p for n, p in self.procs.items() if n == "router"]
        for group in (router, self.workers()):
            for p in group:
                if p.popen.poll() is None:
                    p.popen.send_signal(signal.SIGTERM)
            for p in group:
                try:
                    codes[p.name] = p.popen.wait(wait)
                except subprocess.TimeoutExpired:
                    p.popen.kill()
                    p.popen.wait()
                    codes[p.name] = None
        if self._certs is not None:
            self._certs.close()
            self._certs = self.cluster_tls = None
        return codes


class ThrowawayCa:
    """A stack's cluster CA (cli/certs.py) and a certificate for each of its processes (`members`:
    name -> role), owned here from making to removal. The files are made in a private directory
    on a memory file system (/dev/shm, where there is one), copied into anonymous memory files
    (memfd) and deleted at once: nothing stays on disk, even when the stack's launcher is killed,
    and the memory goes with the last process holding it. Processes read the files as /dev/fd/N
    (`fds(name)`: what process `name` inherits, the CA's and its own). Without memfd (not Linux)
    the directory is the files, removed by close()."""

    def __init__(self, members: Mapping[str, str]) -> None:
        from tandem.cli.certs import make_cluster_ca  # noqa: PLC0415 - cryptography

        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self._dir: str | None = tempfile.mkdtemp(prefix="tandem-certs-", dir=shm)
        self._fds: dict[str, tuple[int, ...]] = {}
        self._tls: dict[str, ClusterTls] = {}
        try:
            made = make_cluster_ca(self._dir, members=members)
            if not hasattr(os, "memfd_create"):
                self._tls = {name: made.tls(name) for name in members}
                return
            ca = _in_memory(made.ca)
            for name in members:
                files = made.tls(name)
                self._fds[name] = (ca, _in_memory(files.cert), _in_memory(files.key))
                self._tls[name] = ClusterTls(*(Path(f"/dev/fd/{fd}") for fd in self._fds[name]))
        except BaseException:
            self.close()  # the directory too, however making it ended
            raise
        shutil.rmtree(self._dir)  # in memory now
        self._dir = None

    def tls(self, name: str) -> ClusterTls:
        """Member `name`'s --cluster-* files (readable in this process and in that member's)."""
        return self._tls[name]

    def fds(self, name: str) -> tuple[int, ...]:
        return self._fds.get(name, ())

    def close(self) -> None:
        for fd in {fd for fds in self._fds.values() for fd in fds}:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = {}
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _in_memory(path: Path) -> int:
    """An anonymous memory file (close-on-exec) holding path's bytes."""
    fd = os.memfd_create(f"tandem-{path.name}")
    os.write(fd, path.read_bytes())
    return fd


def _other_names(names: Sequence[str], roles: Sequence[str]) -> dict[str, str]:
    """Each elastic worker's name in its other role: of each role's names 0..len(names)-1,
    the ones no worker holds, handed out from the last worker back (in a 1P+3D stack decode2
    is prefill1, prefill0 is decode3)."""
    taken = set(names)
    out = {}
    for name, role in reversed(list(zip(names, roles))):
        other = "decode" if role == "prefill" else "prefill"
        out[name] = next(f"{other}{k}" for k in range(len(names)) if f"{other}{k}" not in taken)
        taken.add(out[name])
    return out


def _pin_ports(p: Proc) -> list[str]:
    """p's command line with the ports it bound in place of any it was to pick (0)."""
    argv = list(p.argv)
    port = p.address.rsplit(":", 1)[1] if p.address else "0"
    for flag, value in (("--port", port), ("--grpc-port", port),
                        ("--http-port", str(p.http_port))):
        if flag in argv and value != "0":
            argv[len(argv) - 1 - argv[::-1].index(flag) + 1] = value  # argparse: last wins
    return argv


def _pump(label: list[str], stream: IO[str], log: Path, append: bool = False) -> None:
    """A child's output, line by line: prefixed with its name (label[0], which a role change
    in place renames) on our stdout and kept in its log file. Our stdout may go away (a closed
    pipe): the log is still kept, and the child's pipe drained (a full pipe would block the
    child)."""
    echo = True
    with open(log, "a" if append else "w") as sink:
        for line in stream:
            if echo:
                try:
                    sys.stdout.write(f"[{label[0]}] {line}")
                    sys.stdout.flush()
                except (OSError, ValueError):
                    echo = False
            sink.write(line)
            sink.flush()


def _tail(text: str, n: int = 40) -> str:
    return "\n".join(text.splitlines()[-n:])
