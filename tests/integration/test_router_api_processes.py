"""`tandem router --api-processes 2`: two router processes on the same gRPC and HTTP ports in
front of one colocated worker, mutual TLS between router and worker (the second process reads
the launcher's in-memory credentials as the first does). Connections spread over both (new connections are opened until
the merged /metrics shows that each process finished requests), every answer is the same greedy
output, /metrics from either process carries both processes' series, SIGTERM drains and stops
both (exit 0, none left behind), and the death of the second stops the first (exit 1, for a
supervisor to restart the router)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest

from cluster import WORKER_ARGS, Cluster
from tandem.v1 import api_pb2, api_pb2_grpc, common_pb2

ROUTER_ARGS = ["--api-processes", "2", "--responses-store", "0"]
PROMPT = [5, 17, 42, 99, 123, 7, 256, 31]
SERVED = re.compile(r'^tandem:request_success_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$', re.M)


def children(pid: int) -> list[int]:
    return [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            if b"tandem.cli.main" in Path(f"/proc/{k}/cmdline").read_bytes()]


def served_by_process(metrics: str) -> dict[str, float]:
    """Requests finished by each API process (api_process label -> count)."""
    out: dict[str, float] = {}
    for m in SERVED.finditer(metrics):
        labels = dict(kv.split("=", 1) for kv in m["labels"].split(","))
        if labels.get("role") == '"router"':
            k = labels["api_process"].strip('"')
            out[k] = out.get(k, 0.0) + float(m["value"])
    return out


@pytest.fixture
def cluster(tiny_models, tmp_path):
    c = Cluster(tmp_path, str(tiny_models["llama"]), prefill=0, decode=0, both=1,
                worker_args=WORKER_ARGS, router_args=ROUTER_ARGS, cluster_ca=True).start()
    yield c
    c.stop()


async def generate_on_a_new_connection(address: str) -> list[int]:
    # A local subchannel pool: a connection of this channel's own, not one shared with others.
    async with grpc.aio.insecure_channel(address, options=[
            ("grpc.use_local_subchannel_pool", 1)]) as ch:
        req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=PROMPT),
                                      params=common_pb2.SamplingParams(max_tokens=6,
                                                                       temperature=0.0))
        return [t async for c in api_pb2_grpc.TandemStub(ch).Generate(req, timeout=60)
                for t in c.token_ids]


def test_two_api_processes_share_the_ports_and_stop_together(cluster):
    router = cluster.router.popen
    (second,) = children(router.pid)
    base = f"http://127.0.0.1:{cluster.router.http_port}"
    outputs, served = set(), {}
    for _ in range(64):  # a new connection lands on either process: 2**-63 that one never does
        outputs.add(tuple(asyncio.run(generate_on_a_new_connection(cluster.router.address))))
        with httpx.Client(base_url=base, timeout=30) as http:  # a new connection each time
            r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6,
                                                   "temperature": 0})
            assert r.status_code == 200, r.text
            metrics = http.get("/metrics").text
        served = served_by_process(metrics)
        if len(served) == 2 and all(served.values()):
            break
    assert set(served) == {"0", "1"} and all(served.values()), served
    assert len(outputs) == 1 and len(next(iter(outputs))) == 6, outputs
    asyncio.run(cluster.wait_idle())

    router.send_signal(signal.SIGTERM)
    assert router.wait(timeout=60) == 0
    assert not Path(f"/proc/{second}").exists()  # it drained and exited, and was reaped
    # Both wrote to the router's log, each line saying which process wrote it; a scrape's reads
    # of the other processes' metrics are not logged.
    logs = cluster.router.json_logs()
    assert {line.get("api_process") for line in logs} == {0, 1}
    assert not [line for line in logs if line.get("logger") == "httpx"]


def test_the_death_of_another_api_process_stops_the_router(cluster):
    router = cluster.router.popen
    (second,) = children(router.pid)
    os.kill(second, signal.SIGKILL)
    assert router.wait(timeout=60) == 1
    assert "router API process 1 exited" in cluster.router.log_text()


def router_exits(model: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem.cli.main", "router", "--model",
                           str(model), "--workers", "127.0.0.1:1", "--api-processes", "2",
                           *args], capture_output=True, text=True, timeout=120)


def test_api_processes_refuse_a_responses_store_and_a_port_another_server_holds(tiny_models):
    res = router_exits(tiny_models["llama"])
    assert res.returncode == 2
    assert "argument --api-processes" in res.stderr and "--responses-store 0" in res.stderr
    # The ports are bound shareable: one another server listens on is refused, not shared.
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        res = router_exits(tiny_models["llama"], "--responses-store", "0", "--grpc-port",
                           str(port), "--http-port", "0")
    assert res.returncode == 2
    assert f"argument --grpc-port: cannot listen on 127.0.0.1:{port}" in res.stderr, res.stderr
