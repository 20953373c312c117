"""A `tandem router` process serves without torch: started through the command's own entry
point (cli.main) in a fresh interpreter, in front of a fake colocated worker, it answers a chat
completion with a JSON schema (its grammar checked by a checker process), a completion and a
gRPC Generate, and then holds no torch module, nor transformers' model code.

The router runs in the script's main thread (it handles SIGTERM there, as it does as a
command); a second thread sends the requests once the router's ready file says where it
listens, notes what the process has loaded, and stops it with SIGTERM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.engine.model_source import resolve_model

FAKE_WORKER = Path(__file__).resolve().parents[1] / "fake_worker.py"
# Loaded modules that would mean torch came in: torch itself, what only runs on torch, and
# transformers' model code.
TORCH_MODULES = ("torch", "triton", "xgrammar", "transformers.modeling_utils",
                 "transformers.pytorch_utils")

SCRIPT = r'''
import json, os, signal, sys, threading, time, urllib.request

import grpc

from tandem.cli.main import main

model, worker, ready, heavy = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
report = {}


def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def drive():
    try:
        while not os.path.exists(ready):  # written once the router serves
            time.sleep(0.05)
        grpc_port, http_port = map(int, open(ready).read().split())
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        chat = post(http_port, "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "a", "schema": schema}}})
        text = post(http_port, "/v1/completions", {"model": model, "prompt": "Hello",
                                                   "max_tokens": 1})
        from tandem.v1 import api_pb2, api_pb2_grpc, common_pb2
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
            chunks = list(api_pb2_grpc.TandemStub(ch).Generate(api_pb2.GenerateRequest(
                text="Hello", params=common_pb2.SamplingParams(max_tokens=1)), timeout=120))
        report["finished"] = [chat["choices"][0]["finish_reason"],
                              text["choices"][0]["finish_reason"],
                              chunks[-1].finish_reason]
        # A None entry is an import the process refuses, not a module it loaded.
        report["loaded"] = sorted(
            name for name, module in list(sys.modules.items())
            if module is not None and any(name == h or name.startswith(h + ".") for h in heavy))
    except BaseException as e:
        report["error"] = repr(e)
    finally:
        os.kill(os.getpid(), signal.SIGTERM)


threading.Thread(target=drive, daemon=True).start()
code = main(["router", "--model", model, "--workers", worker, "--grpc-port", "0",
             "--http-port", "0", "--ready-file", ready])
print("REPORT", json.dumps({"code": code, **report}))
'''


@pytest.fixture
def fake_worker():
    p = subprocess.Popen([sys.executable, str(FAKE_WORKER), "--finish"], stdout=subprocess.PIPE,
                         text=True)
    try:
        yield f"127.0.0.1:{int(p.stdout.readline())}"
    finally:
        p.kill()
        p.wait()


def test_a_serving_router_loads_no_torch(fake_worker, tmp_path):
    resolve_model("tandem-demo")  # built here (with torch) if this machine never built it
    res = subprocess.run([sys.executable, "-c", SCRIPT, "tandem-demo", fake_worker,
                          str(tmp_path / "ready"), ",".join(TORCH_MODULES)],
                         capture_output=True, text=True, timeout=300)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("REPORT ")]
    assert lines, f"rc {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    report = json.loads(lines[-1].removeprefix("REPORT "))
    assert "error" not in report, (report, res.stderr[-3000:])
    assert report["finished"] == ["length", "length", "length"]
    assert report["loaded"] == [], report["loaded"]
    assert report["code"] == 0
    assert "PyTorch was not found" not in res.stderr
