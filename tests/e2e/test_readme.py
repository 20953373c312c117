"""The README's main command brings the stack up, and its curl and openai examples work as
written (only the port differs, so the test does not collide with a stack already running)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def block_after(marker: str, lang: str) -> str:
    """The first fenced code block of `lang` after `marker` in the README."""
    start = README.index(marker)
    m = re.compile(rf"```{lang}\n(.*?)```", re.S).search(README, start)
    assert m, f"no {lang} block after {marker!r}"
    return m.group(1)


def test_readme_two_commands_are_make_targets():
    block = block_after("## Two commands", "bash")
    assert "make up" in block and "make test" in block
    makefile = (ROOT / "Makefile").read_text()
    assert "tandem up" in makefile and "pytest" in makefile
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci


def test_tandem_up_and_readme_examples(tmp_path):
    http, grpc_port = free_port(), free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "up.log", "w")  # noqa: SIM115 - closed in finally
    up = subprocess.Popen([sys.executable, "-m", "router_svc.cli", "up", "--http-port",
                           str(http), "--grpc-port", str(grpc_port)],
                          stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert up.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "up.log").read_text()
            time.sleep(0.25)
        # The endpoints banner follows once `tandem up` has seen the router's ready file.
        while "OpenAI HTTP" not in (tmp_path / "up.log").read_text():
            assert time.monotonic() < deadline, (tmp_path / "up.log").read_text()
            time.sleep(0.1)

        curl = block_after("With it running, from another shell", "bash")
        curl = curl.replace("127.0.0.1:8000", f"127.0.0.1:{http}").replace("\\\n", " ")
        out = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60,
                             check=True).stdout
        body = json.loads(out)
        assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"]
        assert body["usage"]["completion_tokens"] == 16
        # The answer the README quotes (greedy: the same every time).
        quoted = re.search(r"answers `(\".*?\")`", README).group(1)
        assert body["choices"][0]["text"] == json.loads(quoted)

        snippet = block_after("or with the `openai` client", "python")
        snippet = snippet.replace("127.0.0.1:8000", f"127.0.0.1:{http}")
        res = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True,
                             timeout=60, env=env)
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == "The capital of France is Paris.", res.stdout
    finally:
        up.send_signal(signal.SIGINT)  # Ctrl-C: drain and stop everything
        code = up.wait(60)
        log.close()
    assert code == 0, (tmp_path / "up.log").read_text()
