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
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.cli.launcher import STARTUP_TIMEOUT_S, LocalStack, Proc


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


class Supervisor:
    def __init__(self, stack: LocalStack, policy: RestartPolicy = RestartPolicy(),
                 say: Callable[[str], None] = print) -> None:
        self.stack = stack
        self.policy = policy
        self.say = say
        self.failed: str | None = None  # why the stack must stop: a process that stays down
        self._watches = {name: _Watch(name) for name in stack.procs}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts so far, by process name."""
        return {name: w.restarts for name, w in self._watches.items()}

    def check(self, now: float | None = None) -> None:
        """One look at every process: note exits, start what waited out its backoff, see
        restarted ones become ready. Returns at once (nothing here waits for a start)."""
        now = time.monotonic() if now is None else now
        for w in self._watches.values():
            if self.failed is None:
                self._check(w, self.stack.procs[w.name], now)

    def _check(self, w: _Watch, p: Proc, now: float) -> None:
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
            while not self._stop.wait(interval_s) and self.failed is None:
                self.check()

        self.stack.supervisor = self  # the stack stops it before stopping its processes
        self._thread = threading.Thread(target=loop, name="supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
