"""`tandem up` supervises its processes: a worker killed with SIGKILL is restarted on its address
and serves again; one that cannot be restarted (here its port is taken) stops the stack with exit
code 1 and a message naming it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from cluster import free_port


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _worker_pid(up_pid: int, name: str) -> int:
    (pid,) = [c for c in _children(up_pid)
              if f"{name}.ready".encode() in Path(f"/proc/{c}/cmdline").read_bytes()]
    return pid


def _wait(condition, what: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_killed_worker_restarts_and_one_that_cannot_stops_the_stack(tiny_models, tmp_path):
    http = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli.main", "up", "--device", "cpu", "--model",
         str(tiny_models["llama"]), "--http-port", str(http), "--grpc-port", "0",
         "--log-dir", str(tmp_path), "--max-restarts", "1", "--restart-window", "600",
         "--worker-arg=--num-blocks=64"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    output: list[str] = []
    reader = threading.Thread(target=output.extend, args=(proc.stdout,), daemon=True)
    reader.start()
    text = lambda: "".join(output)  # noqa: E731
    blocker = socket.socket()
    try:
        _wait(lambda: "Ctrl-C stops everything" in text() or proc.poll() is not None,
              "no banner")
        assert "a process that exits is restarted (at most 1 times in 600 s)" in text(), text()
        port = int((tmp_path / "decode0.ready").read_text())
        os.kill(_worker_pid(proc.pid, "decode0"), signal.SIGKILL)
        _wait(lambda: f"decode0 is back on 127.0.0.1:{port} (restart 1)" in text(), text())
        with httpx.Client(base_url=f"http://127.0.0.1:{http}", timeout=60) as h:
            _wait(lambda: h.get("/health").status_code == 200, "router never saw it back")
            r = h.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4})
            assert r.status_code == 200, r.text

        # Killed again, its port taken before it can bind: the second exit within the window
        # is one more than --max-restarts 1 allows.
        os.kill(_worker_pid(proc.pid, "decode0"), signal.SIGKILL)
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT
        _wait(lambda: _try_bind(blocker, port), f"port {port} stayed taken")
        blocker.listen()
        assert proc.wait(240) == 1, text()
        reader.join(10)
        assert "decode0 cannot be restarted: it exited 2 times within 600 s" in text(), text()
    finally:
        blocker.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _try_bind(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True
