"""No process of a stack outlives `tandem up`, however it ends: its output closed under it
(`| head`, SIGPIPE), Ctrl-C to a pipeline's process group (`| tee log`), SIGKILL. Every
process it started (router, workers, their engine cores) exits and the ports are free again.
Ctrl-C with a stream in flight ends the stream with [DONE] and no traceback, whether it
finished within the grace period or was ended when it ran out; the stack's cluster CA is never
on disk."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

from cluster import Handed, free_port

BOUND_S = 180.0  # generous: a loaded machine starts and drains slowly; nothing waits this long


def _wait(condition: Callable[[], bool], what: Callable[[], str] | str,
          timeout: float = BOUND_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.05)


def _descendants(pid: int) -> set[int]:
    """pid's children, theirs, and so on (Linux /proc)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:  # exited meanwhile
            continue
        for k in map(int, kids):
            if k not in found:
                found.add(k)
                todo.append(k)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; its parent (gone or not) reaps it


def _free(port: int) -> bool:
    try:
        socket.create_server(("127.0.0.1", port)).close()
    except OSError:
        return False
    return True


class Up:
    """`tandem up` on the tiny llama with fixed free ports; `cmd` prefixes a pipeline."""

    def __init__(self, tiny_models: dict, tmp: Path, *extra: str) -> None:
        self.http, self.grpc = free_port(), free_port()
        self.tmp = tmp
        self.argv = [sys.executable, "-m", "tandem.cli.main", "up", "--device", "cpu", "--model",
                     str(tiny_models["llama"]), "--http-port", str(self.http), "--grpc-port",
                     str(self.grpc), "--log-dir", str(tmp / "logs"), "--num-blocks", "64", *extra]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def shell(self, pipeline: str) -> str:
        return " ".join(f"'{a}'" for a in self.argv) + " " + pipeline

    def stack_pids(self, root: int) -> set[int]:
        """The stack's processes under root, once all are up: 2 workers, each with an engine
        core, and a router (multiprocessing's resource trackers besides)."""
        pids: set[int] = set()

        def grown() -> bool:
            pids.update(_descendants(root))
            cmdlines = [_cmdline(p) for p in pids]
            return (sum(b"router" in c and b"tandem.cli.main" in c for c in cmdlines) == 1
                    and sum(b"spawn_main" in c for c in cmdlines) >= 2)

        _wait(grown, "the stack's processes never all started")
        return pids

    def assert_all_gone(self, pids: set[int]) -> None:
        _wait(lambda: not any(_alive(p) for p in pids),
              lambda: f"still running: {[(p, _cmdline(p)[:120]) for p in pids if _alive(p)]}")
        _wait(lambda: _free(self.http) and _free(self.grpc), "the stack's ports stayed taken")
        left = [p for p in Path("/dev/shm").glob("tandem-kv-*")
                if p.name.split("-")[2] in {str(pid) for pid in pids}]
        assert not left, left


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return b""


def _banner_seen(path: Path) -> Callable[[], bool]:
    return lambda: path.exists() and "Ctrl-C stops everything" in path.read_text()


class Running(NamedTuple):
    """`tandem up` started by the test, up to its banner, and the stack's processes."""
    up: Up
    proc: subprocess.Popen
    log: Path
    pids: set[int]


def start_up(tiny_models: dict, tmp: Path) -> Running:
    up = Up(tiny_models, tmp)
    log = tmp / "up.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(up.argv, stdout=out, stderr=subprocess.STDOUT, env=up.env)
    try:
        _wait(_banner_seen(log), lambda: log.read_text())
        return Running(up, proc, log, up.stack_pids(proc.pid))
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def interrupt(r: Running) -> None:
    """Ctrl-C: the stack drains and `tandem up` exits 0."""
    r.proc.send_signal(signal.SIGINT)
    assert r.proc.wait(BOUND_S) == 0, r.log.read_text()


@pytest.fixture(scope="module")
def ups(tiny_models, tmp_path_factory):
    """A `tandem up` stack: the cluster CA test only reads it, then the SIGKILL test takes it
    (each starts its own when run alone)."""
    stacks = Handed(lambda: start_up(tiny_models, tmp_path_factory.mktemp("up")), interrupt)
    yield stacks
    stacks.close()


def test_no_key_of_the_cluster_ca_is_on_disk(ups):
    """The throwaway CA lives in memory files (memfd) that every process reads as /dev/fd/N:
    nothing of it in the log directory, nothing to remove after a SIGKILL."""
    r = ups.get()
    assert "Internal:    mutual TLS, a throwaway cluster CA held in memory" in r.log.read_text()
    keys = {}
    for pid in r.pids:
        argv = _cmdline(pid).split()
        if b"--cluster-key" in argv:
            keys[pid] = argv[argv.index(b"--cluster-key") + 1].decode()
    assert len(keys) == 3, keys  # the router and both workers
    memfds = set()
    for pid, key in keys.items():
        assert key.startswith("/dev/fd/"), key
        memfd = os.readlink(f"/proc/{pid}/fd/{key.removeprefix('/dev/fd/')}")
        assert memfd.startswith("/memfd:"), key
        memfds.add(memfd)
    assert len(memfds) == 3, memfds  # each its own key: router0 never holds prefill0's
    assert not [p.name for p in (r.up.tmp / "logs").rglob("*") if p.suffix in (".key",
                                                                                ".pem")]


def test_sigkill_of_tandem_up_takes_every_process_with_it(ups):
    r = ups.take()
    try:
        r.proc.kill()
        r.proc.wait()
        r.up.assert_all_gone(r.pids)
        assert not [p.name for p in (r.up.tmp / "logs").rglob("*") if p.suffix in (".key",
                                                                                    ".pem")]
    finally:
        if r.proc.poll() is None:
            r.proc.kill()
            r.proc.wait()


def test_output_closed_under_it_stops_the_stack(tiny_models, tmp_path):
    """`tandem up | head -n 2`: here the reader closes the pipe once the stack is up (head
    would close it after its second line, mid-start-up: that case stops the start)."""
    up = Up(tiny_models, tmp_path)
    proc = subprocess.Popen(up.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=up.env)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if b"Ctrl-C stops everything" in line:
                break
        pids = up.stack_pids(proc.pid)
        proc.stdout.close()  # nobody reads any more: its next write would get EPIPE
        up.assert_all_gone(pids)
        assert proc.wait(BOUND_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_head_of_a_pipeline_leaves_nothing_running(tiny_models, tmp_path):
    """`tandem up 2>&1 | head -n 2` as typed: head leaves during start-up."""
    up = Up(tiny_models, tmp_path)
    sh = subprocess.run(["bash", "-c", up.shell("2>&1 | head -n 2")], env=up.env,
                        capture_output=True, timeout=BOUND_S)
    assert len(sh.stdout.splitlines()) == 2, sh
    # The shell waited for `tandem up` too: whatever it had started has exited, or does now.
    started = [p for p in map(int, filter(str.isdigit, os.listdir("/proc")))
               if str(tmp_path / "logs").encode() in _cmdline(p)]
    up.assert_all_gone(set(started))


def test_sigint_to_a_pipelines_group_stops_everything(tiny_models, tmp_path):
    """`tandem up 2>&1 | tee log`, then Ctrl-C: the terminal sends SIGINT to the pipeline's
    process group, tee included, so `tandem up` drains and stops with its output gone."""
    up = Up(tiny_models, tmp_path)
    log = tmp_path / "tee.log"
    shell = subprocess.Popen(["bash", "-c", up.shell(f"2>&1 | tee '{log}' > /dev/null")],
                             env=up.env, start_new_session=True)  # its own process group
    try:
        _wait(_banner_seen(log), lambda: log.read_text() if log.exists() else "no log")
        pids = up.stack_pids(shell.pid)
        os.killpg(shell.pid, signal.SIGINT)
        up.assert_all_gone(pids)
        shell.wait(BOUND_S)
        assert "Traceback" not in (tmp_path / "logs" / "router.log").read_text()
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()


def test_ctrl_c_ends_an_open_stream_with_done_and_no_traceback(tiny_models, tmp_path):
    """A stream longer than the grace period (1 s): Ctrl-C drains for the grace period, then
    ends it with an error event and [DONE], not a cut connection and a traceback. (A stream
    that ends within the grace period runs to its own end: tests/e2e/test_tandem_up.py.)"""
    up = Up(tiny_models, tmp_path, "--grace", "1")
    log = tmp_path / "up.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(up.argv, stdout=out, stderr=subprocess.STDOUT, env=up.env)
    events: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{up.http}/v1/completions", json=body,
                          timeout=BOUND_S) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    started.set()

    try:
        _wait(_banner_seen(log), lambda: log.read_text())
        pids = up.stack_pids(proc.pid)
        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(BOUND_S)
        proc.send_signal(signal.SIGINT)
        reader.join(BOUND_S)
        assert proc.wait(BOUND_S) == 0, log.read_text()
        up.assert_all_gone(pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    # Ended at the grace period's end, or (a fast machine) finished within it.
    assert (last.get("error", {}).get("code") == "shutting_down"
            or last["choices"][0]["finish_reason"] == "length"), last
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
