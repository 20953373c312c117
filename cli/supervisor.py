"""Keeps a LocalStack's processes running (`tandem up`): one that exits is started again, as it
was started and on the address it had, so the router's worker list and the decode workers'
peers stay valid; the router takes a restarted worker back in when it answers its poll.

    exit ──▶ wait backoff (0.5 s, doubling per recent exit, at most 10 s) ──▶ start ──▶ ready
      ▲                                                                        │
      └──────────────── exits again (while starting or later) ◀────────────────┘

A process that exits more than `max_restarts` times within `window_s` seconds cannot be
restarted: the supervisor gives up, saying which process and why (`failed`), and the stack
stops. Every restart is logged and counted (`restarts`); the router counts the restarts it sees
in its metrics (tandem:worker_restarts_total). A hung process (alive, not answering) is the
router's to route around (router_svc/workers.py), not restarted here.

On an elastic stack (LocalStack(elastic=True)) it also changes workers' roles, one at a time
(`convert`, which cli/elastic.py calls on the planner's word). In place, by default:

    convert(decode1, prefill) ──▶ out of the router's workers file; SwitchRole RPC: drained
        (its requests move to another decode worker, or finish), then the same process, its
        model and KV pool loaded, serves as prefill1 on a new port (runtime/role_switch.py)
        ──▶ in the workers file (the router polls it, then routes to it)

A worker that cannot change in place says so before draining (SwitchRole FAILED_PRECONDITION),
and is restarted instead:

    ──▶ Drain RPC ──▶ it exits ──▶ started as prefill1 on its device, on a new port ──▶ ready
        ──▶ in the workers file

A drained worker's exit is the conversion's, never restarted (one that drained and then could
not switch exits too: ABORTED). A drain that fails while the worker still runs gives the
conversion up: the worker is put back in the file, as it was.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from tandem.cli.launcher import STARTUP_TIMEOUT_S, LocalStack, Proc

ROLES = ("prefill", "decode")  # what a worker can be converted to


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5  # exits within window_s that are restarted; one more gives up
    window_s: float = 60.0
    backoff_s: float = 0.5  # before the first restart; doubles with each recent exit
    max_backoff_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.backoff_s < 0:
            raise ValueError(f"bad restart policy {self}")

    def delay(self, recent_exits: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, recent_exits - 1))


@dataclass
class _Watch:
    """One process's restart state: the supervisor is its only owner."""

    name: str
    exits: deque[float] = field(default_factory=deque)  # monotonic times, within the window
    restart_at: float | None = None  # an exit waiting out its backoff
    starting_since: float | None = None  # restarted, not ready yet
    restarts: int = 0


@dataclass
class Conversion:
    """One role change, from asking to done: the supervisor's, one at a time."""

    name: str  # the worker as it was (decode1)
    role: str  # what it becomes
    reason: str
    new_name: str = ""  # once started in its new role (prefill1)
    address: str = ""  # once that is up
    drain: threading.Thread | None = None
    drain_error: str | None = None  # the Drain RPC failed (the worker may still run)
    exit_code: int | None = None  # the drained worker's (0: nothing was left behind)
    moved: int = 0  # what its drain answered: requests moved to other workers...
    finished: int = 0  # ...finished there, and left behind (cut at its --grace)
    left: int = 0
    switched_to: str = ""  # changed in place: where it serves its new role
    switch_seconds: float | None = None  # ...and how long, drained to serving, it took there
    done: bool = False
    failed: str | None = None  # why it was given up
    # When each step ended (time.monotonic(); None: not reached): asked (convert), drained
    # (its drain done), exited (the process gone: restarted only), ready (serving its new
    # role, in the workers file). benchmarks/robustness/role_change.py prints them.
    asked_at: float = field(default_factory=time.monotonic)
    drained_at: float | None = None
    exited_at: float | None = None
    ready_at: float | None = None


class Supervisor:
    def __init__(self, stack: LocalStack, policy: RestartPolicy = RestartPolicy(),
                 say: Callable[[str], None] = print, in_place: bool = True) -> None:
        self.stack = stack
        self.policy = policy
        self.say = say
        self.in_place = in_place  # False: every role change restarts its worker
        self.failed: str | None = None  # why the stack must stop: a process that stays down
        self._watches = {name: _Watch(name) for name in stack.procs}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # convert() (any thread) against check()
        self._asked: Conversion | None = None  # convert() asked, check() not yet begun
        self.conversion: Conversion | None = None  # the one under way, check()'s alone
        self.conversions: list[Conversion] = []  # ended ones, done or given up
        self.converted = threading.Condition()  # notified when a conversion ends
        # Set when a role change is asked and when its call returns: the next check() need
        # not wait its turn.
        self.woken = threading.Event()

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts so far, by process name."""
        return {name: w.restarts for name, w in self._watches.items()}

    def check(self, now: float | None = None) -> None:
        """One look at every process: note exits, start what waited out its backoff, see
        restarted ones become ready. Returns at once (nothing here waits for a start)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            asked, self._asked = self._asked, None
            if asked is not None:
                self.conversion = asked
        if asked is not None:
            self._begin(asked)
        for w in list(self._watches.values()):
            if self.failed is None:
                self._check(w, self.stack.procs[w.name], now)

    # -- role changes ------------------------------------------------------------------------
    @property
    def converting(self) -> bool:
        with self._lock:
            return self._asked is not None or self.conversion is not None

    def convert(self, name: str, role: str, reason: str = "asked") -> None:
        """Ask for worker `name` to become a `role` worker (done by check(): returns at once;
        `wait_converted` waits for it). One conversion at a time."""
        if not self.stack.elastic:
            raise ValueError("role changes need an elastic stack (tandem up --elastic)")
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if name not in self.stack.procs or name == "router":
            raise ValueError(f"no worker named {name!r}")
        if name.rstrip("0123456789") == role:
            raise ValueError(f"{name} is a {role} worker already")
        with self._lock:
            if self._asked is not None or self.conversion is not None:
                raise RuntimeError("a role change is under way: one at a time")
            self._asked = Conversion(name, role, reason)
        self.woken.set()  # begun by the next check(), at once

    def wait_converted(self, count: int = 1, timeout: float | None = None) -> list[Conversion]:
        """Until `count` conversions have ended (done or given up); what they were."""
        with self.converted:
            if not self.converted.wait_for(lambda: len(self.conversions) >= count, timeout):
                raise TimeoutError(f"{len(self.conversions)} of {count} role changes ended")
            return list(self.conversions)

    def _begin(self, c: Conversion) -> None:
        p = self.stack.procs[c.name]
        self.say(f"{c.name} becomes a {c.role} worker ({c.reason}): draining it")
        self.stack.write_workers_file(without=c.name)  # the router sends it nothing new
        c.drain = threading.Thread(target=self._switch_or_drain, args=(c, p), daemon=True,
                                   name=f"drain {c.name}")
        c.drain.start()

    def _switch_or_drain(self, c: Conversion, p: Proc) -> None:
        """In a thread (it takes as long as the requests there do): the change in place, or,
        where the worker cannot, the drain that precedes its restart."""
        if not self.in_place or self._switch(c, p):
            self._drain(c, p)
        self.woken.set()

    def wait(self, timeout: float) -> None:
        """Until the next check() is due: `timeout`, or sooner when a role change was asked
        or its call returned (its worker serves its new role, or drained)."""
        self.woken.wait(timeout)
        self.woken.clear()

    def _credentials(self, c: Conversion) -> tuple[grpc.ChannelCredentials | None, str | None]:
        """The router's certificate, and the name the worker's must carry (its role's)."""
        from tandem.runtime.cluster_roles import peer_name  # noqa: PLC0415 - as drain, on use

        tls = self.stack.cluster_tls
        if tls is None:
            return None, None
        return tls.channel_credentials(), peer_name(c.name.rstrip("0123456789"))

    def _switch(self, c: Conversion, p: Proc) -> bool:
        """The SwitchRole RPC (answered once the worker serves its new role); True when the
        worker cannot change in place and must be drained and restarted instead."""
        from tandem.cli.health import channel  # noqa: PLC0415 - gRPC stubs
        from tandem.v1 import worker_pb2, worker_pb2_grpc  # noqa: PLC0415 - gRPC stubs

        try:
            creds, server_name = self._credentials(c)
            with channel(p.address, creds, server_name) as ch:
                r = worker_pb2_grpc.WorkerStub(ch).SwitchRole(
                    worker_pb2.SwitchRoleRequest(role=c.role), timeout=self.stack.grace + 30)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
                self.say(f"{c.name} cannot change role in place ({e.details()}): restarting it "
                         "instead")
                return True  # nothing was drained
            if e.code() == grpc.StatusCode.ABORTED:  # drained, then failed: it exits
                c.drained_at = time.monotonic()
                self.say(f"{c.name} did not change role in place ({e.details()}); it is "
                         "restarted")
            else:
                c.drain_error = f"{e.code().name}: {e.details()}"
            return False
        except (OSError, ValueError) as e:  # the certificates could not be read
            c.drain_error = str(e)
            return False
        c.drained_at = time.monotonic() - r.switch_seconds
        c.moved, c.finished, c.left = r.moved, r.finished, r.left
        c.switched_to, c.switch_seconds = r.address, r.switch_seconds
        self.say(f"{c.name} drained in {r.drain_seconds:.1f} s: {r.moved} requests moved, "
                 f"{r.finished} finished there, {r.left} left; changed role in "
                 f"{r.switch_seconds:.2f} s")
        return False

    def _drain(self, c: Conversion, p: Proc) -> None:
        """The Drain RPC, as `tandem drain` makes it (answered once the worker is drained; it
        then exits 0)."""
        from tandem.cli.drain import drain  # noqa: PLC0415 - gRPC stubs

        try:
            r = drain(p.address, self.stack.grace + 30, *self._credentials(c))
        except grpc.RpcError as e:
            c.drain_error = f"{e.code().name}: {e.details()}"
        except (OSError, ValueError) as e:  # the certificates could not be read
            c.drain_error = str(e)
        else:
            c.drained_at = time.monotonic()
            c.moved, c.finished, c.left = r.moved, r.finished, r.left
            self.say(f"{c.name} drained in {r.seconds:.1f} s: {r.moved} requests moved, "
                     f"{r.finished} finished there, {r.left} left")

    def _check_conversion(self, w: _Watch, p: Proc, now: float) -> bool:
        """The converting worker's step, if `w` is it (True: handled here)."""
        c = self.conversion
        if c is None:
            return False
        if w.name == c.new_name:
            if w.starting_since is None or p.popen.poll() is not None \
                    or not self.stack.read_ready(p):
                return False  # starting, or failed to: restarted as any process is
            w.starting_since = None
            c.address, c.done = p.address, True
            self.stack.write_workers_file()
            c.ready_at = time.monotonic()
            self.say(f"{c.name} is now {c.new_name}, a {c.role} worker on {p.address} "
                     f"({c.reason})")
            self._end(c)
            return True
        if w.name != c.name:
            return False
        if p.popen.poll() is None:
            if c.drain is None or c.drain.is_alive():
                return True
            if c.switched_to:
                self._switched(c, w)
            elif c.drain_error is not None:
                c.failed = f"drain failed: {c.drain_error}"
                self.stack.write_workers_file()  # back in, as it was
                self.say(f"{c.name} stays a {c.name.rstrip('0123456789')} worker: {c.failed}")
                self._end(c)
            return True
        c.exit_code = p.popen.returncode
        c.exited_at = time.monotonic()
        new = self.stack.replace_worker(c.name, c.role)
        c.new_name = new.name
        del self._watches[c.name]
        self._watches[new.name] = _Watch(new.name, starting_since=now)
        self.say(f"{c.name} exited with {p.popen.returncode}; starting it as {new.name}")
        return True

    def _switched(self, c: Conversion, w: _Watch) -> None:
        """The worker changed role in place: renamed in the stack (its watch, restarts
        counted, with it), and back in the workers file at its new address."""
        new = self.stack.switched_worker(c.name, c.role, c.switched_to)
        c.new_name, c.address, c.done = new.name, new.address, True
        w.name = new.name
        self._watches[new.name] = self._watches.pop(c.name)
        self.stack.write_workers_file()
        c.ready_at = time.monotonic()
        self.say(f"{c.name} is now {new.name}, a {c.role} worker on {new.address}, changed in "
                 f"place ({c.reason})")
        self._end(c)

    def _end(self, c: Conversion) -> None:
        with self._lock:
            self.conversion = None
        with self.converted:
            self.conversions.append(c)
            self.converted.notify_all()

    def _check(self, w: _Watch, p: Proc, now: float) -> None:
        if self._check_conversion(w, p, now):
            return
        if w.restart_at is not None:
            if now >= w.restart_at:
                w.restart_at, w.starting_since = None, now
                w.restarts += 1
                self.stack.restart(w.name)
            return
        code = p.popen.poll()
        if w.starting_since is not None:
            if code is None and self.stack.read_ready(p):
                w.starting_since = None
                self.say(f"{w.name} is back on {p.address} (restart {w.restarts})")
                return
            if code is None and now - w.starting_since > STARTUP_TIMEOUT_S:
                p.popen.kill()
                code = p.popen.wait()
            if code is None:
                return
            w.starting_since = None
        elif code is None:
            return
        self._exited(w, p, code, now)

    def _exited(self, w: _Watch, p: Proc, code: int, now: float) -> None:
        w.exits.append(now)
        while w.exits and now - w.exits[0] > self.policy.window_s:
            w.exits.popleft()
        recent = len(w.exits)
        if recent > self.policy.max_restarts:
            self.failed = (f"{w.name} cannot be restarted: it exited {recent} times within "
                           f"{self.policy.window_s:.0f} s (last exit code {code}); log: {p.log}")
            return
        delay = self.policy.delay(recent)
        w.restart_at = now + delay
        self.say(f"{w.name} exited with {code}; restarting it in {delay:.1f} s (restart "
                 f"{w.restarts + 1}; {recent} exit(s) in the last {self.policy.window_s:.0f} s)")

    # -- in a thread (tests, benchmarks) -----------------------------------------------------
    def start(self, interval_s: float = 0.1) -> Supervisor:
        def loop() -> None:
            while not self._stop.is_set() and self.failed is None:
                self.wait(interval_s)
                if not self._stop.is_set():
                    self.check()

        self.stack.supervisor = self  # the stack stops it before stopping its processes
        self._thread = threading.Thread(target=loop, name="supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.woken.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
